"""Where a checkpoint's bytes go: the storage front and what lives on a root.

It imports only `_format` (what the bytes mean) among its siblings: both paths and the CLI
build on it, never the other way round. Torch-free, so `ckptctl list/show/verify` start fast.

    storage.py      Storage, the front every caller uses: names validated and joined to
                    the root, backend errors translated, transient failures of remote
                    stores retried (`retrying`), `capabilities` (callers ask these, never
                    the protocol).
    backends/       the backend seam (base.py: the StorageBackend Protocol, Capabilities)
                    and one module per store: local.py (rename/link, O_DIRECT, flock),
                    s3.py (uploads from the buffer, If-None-Match / If-Match; its
                    multipart.py), fsspec.py (any other fsspec filesystem, memory://
                    included); the registry picks one by URI scheme. The only place that
                    knows protocols (an ast test enforces it).
    backend_errors.py  backend errors into the StorageError tree; transient, precondition
                    and version-conflict replies of object stores.
    options.py      S3Options: fsspec options for s3:// roots, shared by the daemon's
                    start-up checks and `ckptctl`.
    indexes.py      rank index objects on storage: the writer's write with the shard file's
                    final size and checksum, checked reads, complete_manifest for tools.
    steps.py        the step folders: listing steps, manifest reading, file verification,
                    start-up removal of dead attempts; remove_uncommitted_step, the one
                    guarded removal of an uncommitted step folder (never one that holds a
                    manifest).
    pins.py         pinned steps under `_pins/` (shared with ckptctl).
    root_catalog.py `_CATALOG.json`, the index of committed steps at the root (entries with
                    size, world size, metrics, pinned), updated by compare-and-swap at each
                    commit, retention deletion and pin; never trusted over a manifest.
    listing.py      committed steps from the catalog reconciled with one listing of the step
                    folders (manifests read only for steps it lacks), and the catalog repair.
    lease.py        Lease on the root: conditional take/refresh/release, takeover only after
                    expiry on our own clock or a provably dead holder, fencing (confirm).
    probe.py        check_root_writable: a root's quick start-up check, each backend's own
                    `probe` (a probe file on local disk; endpoint and bucket on S3).
    quarantine.py   a committed step that fails verification moved aside to `_quarantine/`
                    under the lease, with a record of why (`QUARANTINE.json`, indexed in the
                    catalog); listing and removal of quarantined folders.
    publish.py      publish_manifest, the one commit path (the save's coordinator and
                    `ckptctl reshard`): lease fence, exclusive manifest write (an existing
                    manifest read back: ours or a CONFLICT), root catalog record;
                    CommitResult / CommitOutcome.
"""
