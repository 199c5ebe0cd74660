"""The storage layer: bytes, names and formats on a checkpoint root.

It imports none of its sibling sub-packages (`_save`, `_load`, `_retention`, `ctl`): both paths
and the CLI build on it, never the other way round. Only `format.py`, `tree.py` and `dtensor.py`
need torch; the rest stays torch-free so `ckptctl list/show/verify` start fast.

    storage.py      Storage: every URL/path operation (fsspec), atomic + exclusive writes,
                    conditional writes (read_with_version / write_if),
                    multipart uploads, error translation; validate_relative_name.
    multipart.py    S3 uploads straight from a buffer (no copy), aborted on failure;
                    listing and aborting incomplete uploads left by killed writers.
    backend_errors.py  backend errors into the StorageError tree; transient, precondition
                    and version-conflict replies of object stores.
    options.py      S3Options: fsspec options for s3:// roots, shared by the daemon's
                    start-up checks and `ckptctl`.
    direct_write.py large local writes with O_DIRECT from page-aligned slabs, buffered tail
                    and fallback.
    manifest.py     layout names (step-<N:012d>, rank-<r:05d>.bin, rank-<r:05d>.index.json,
                    manifest.json, _pins/; spread_prefix for request spreading on S3),
                    Manifest schema with validation: format 2's small top manifest and
                    format 1's inline pieces.
    rank_index.py   per-rank index objects (format 2): build, write, read and check against
                    the top manifest; RankReport (what a rank tells the coordinator);
                    complete_manifest (every index merged in, for tools).
    checksum.py     file checksums by algorithm (ChecksumAlgorithm): CRC-32 through ISA-L
                    (zlib fallback; older manifests), CRC-32C (new saves) through ISA-L
                    `crc32_iscsi` (`crc32c` package fallback).
    format.py       shard file format: magic + JSON header + aligned raw tensor bytes.
    dtypes.py       dtype names and item sizes without torch (manifest validation).
    tree.py         state <-> JSON skeleton + tensor leaves (replicated, sharded, rank-local).
    dtensor.py      DTensor leaves as box pieces (replicas write once); restore templates
                    with DTensors wrapped and unwrapped around the load.
    catalog.py      listing steps, manifest reading, file verification, start-up removal of
                    dead attempts; remove_uncommitted_step, the one guarded removal of an
                    uncommitted step folder (never one that holds a manifest).
    pins.py         pinned steps under `_pins/` (shared with ckptctl).
    root_catalog.py `_CATALOG.json`, the index of committed steps at the root (entries with
                    size, world size, metrics, pinned), updated by compare-and-swap at each
                    commit, retention deletion and pin; never trusted over a manifest.
    listing.py      committed steps from the catalog reconciled with one listing of the step
                    folders (manifests read only for steps it lacks), and the catalog repair.
    lease.py        Lease on the root: conditional take/refresh/release, takeover only after
                    expiry on our own clock or a provably dead holder, fencing (confirm).
"""
