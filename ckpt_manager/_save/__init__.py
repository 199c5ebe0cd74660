"""The save path: from `CheckpointManager.save()` to a committed manifest.

A save is snapshotted into shared staging memory on the trainer side, written to storage by a
persistent writer process, then finalized across ranks (agreement, then one manifest commit).

    request.py      SaveRequest: one save on one rank; its explicit SaveState machine
                    STAGING -> WRITING -> OK | FAILED, guarded transitions, one lock;
                    write_blocking_next_save (would a save now wait on a write in flight).
    pipeline.py     LocalPipeline: one rank's staging buffers, staging thread and writer.
    plan.py         what a rank writes (leaves_to_write) and its shard file's plan
                    (piece_records; PlanCache reuses layout and records while the state
                    keeps its keys, dtypes, shapes and placements).
    staging.py      Slab (memfd shared memory reused across saves; huge pages where shmem
                    THP is `advise`), copy_into_slab (copies and checksums chunk by chunk;
                    the slab keeps its layout's copy program: batches and slot views),
                    BackgroundThread (the staging thread).
    chunk_copy.py   the staging copy's byte copy: CopyKind STREAMING (non-temporal stores,
                    the optional C helper `_streaming_copy.c`) or MEMMOVE (libc, without it).
    device_copy.py  CUDA snapshots: DeviceFence (events), copy_to_pinned_slab on a dedicated
                    copy stream into a page-locked slab, fenced on the compute stream.
    landed_checksums.py  LandedChecksums: a CUDA snapshot's CRC-32C, part by part on up to
                    4 threads as the device copy lands, folded in order.
    writer.py       the writer process (no torch): request loop, write_shard (straight from
                    the slab, no checksum pass), fault hooks.
    writer_proc.py  WriterProcess: trainer-side handle (start, submit, poll, stop, kill).
    finalize.py     Finalizer: saves in flight; agree, commit or fail across ranks, report
                    (collectives issued in one maybe_finalize call, read in a later one).
    report.py       a rank's contribution (prepare_rank: its pending index and the draft
                    of its report; ReportCache reuses them, and the tensor list's pickle,
                    while the plan is unchanged) and the report it sends the coordinator
                    (rank_report, encoded and decoded for the gather).
    commit.py       the coordinator's commit: the format-2 top manifest from the reports
                    alone (build_top_manifest; TopTensors reuses the merged tensor records
                    while every rank's tensor list is unchanged), published by
                    `_store/publish.py`.
"""
