"""The memory tier: every save snapshots the rank's whole state into a slot file on a tmpfs.

Modules:

    slots.py   a rank's slot files: payload allocation (`posix_fallocate`), atomic metas
               (torch-free)
    plan.py    what a payload holds and where: the durable shard file, then the leaves it
               dedups away on this rank; layout fingerprints; the plan cache
    meta.py    the meta JSON written next to a complete payload, and its parser
    meta_reader.py  `MetaReader`: a slot directory's complete metas, each file version parsed
               once (the daemon's replica threads poll them; torch-free)
    tier.py    `MemoryTier`: which slot a snapshot takes, what the slots hold, counters;
               `SnapshotJob`: the memory part of one save
    load.py    verify a payload's checksum, rebuild its state or fill a template
    agree.py   the restore agreement: the newest step every rank holds and verifies
    floor.py   the durable floor: the newest step the run holds durably, recorded in the
               tier so that no memory step older than it is restored (torch-free)

[Note: the memory tier] With `CheckpointConfig(memory=MemoryTierConfig(directory))`, the
staging buffer of every save is a slot file in `directory` (mapped shared, like the memfd it
replaces), so the staging copy *is* the snapshot: no second copy of the state. `save(step,
state, durable=False)` stops there (no writer, no manifest, no agreement); `durable=True`
also hands the same slot to the writer, which writes the durable shard file from its first
bytes as before. A slot's meta is written once its copy is complete and removed before it is
overwritten, so a rank killed mid-copy leaves that slot empty and the previous one intact
([Note: which slot a snapshot takes] in `tier.py`). The slot files outlive the rank (SIGKILL
included); the caller owns the directory and removes it.

`restore()` (no explicit step) first agrees on the newest step every rank holds complete and
verified in memory (`agree.py`) and rebuilds it from the rank's own slot only: no storage
read, no collective beyond the agreement and one exchange of the load's outcome. Anything
else falls back to the durable tier with the reason (`RestoreResult.fallback_reason`), and so
does a memory step older than a step the run holds durably ([Note: a memory step older than a
durable one is stale] in `floor.py`).
Memory steps may be newer than the newest committed step; they never change how durable
steps are numbered or retained.
"""
