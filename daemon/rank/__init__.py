"""The rank process: one per local rank, started by the elastic agent or a plain `torchrun`.

Its entry point is `daemon/worker.py` (`elastic_entry`, `python -m daemon.worker`).

Module plan:
    loop.py           the training loop: data -> forward/backward -> step -> metrics -> ckpt.
    data.py           `ShardedLoader`: rank-sharded, deterministic, checkpointable position.
    batch.py          a micro-batch: `(inputs, targets)` or a dict (`model(**batch)`), its loss.
    prefetch.py       `PrefetchingLoader`: batches read ahead on one thread, position as consumed.
    token_data.py     `--data`: the job's `train_data` replaced by a `TokenDataset` of files
                      (`--val-data`: its `val_data`).
    evaluation.py     `Evaluator`: the validation loss every `eval_every` steps, fixed batches,
                      token-weighted over all ranks.
    permutation.py    `FeistelPermutation`: the per-epoch order of [0, n), O(1) memory in n.
    telemetry.py      rank-side metric recording, published as the rank's snapshot file.
    phase_watch.py    publishes a phase that lasts: a blocked checkpoint call says
                      `checkpointing`, a quick one costs no file write.
    throughput.py     per-rank tokens/s, MFU (peak FLOP/s table) and CUDA memory figures.
    save_failures.py  the run's save failure policy: report, keep training, give up after N.
    deferral.py       `DeferredSaves`: a durable save due while an earlier one is still being
                      written is deferred (counted, logged once), taken when the write ends.
    memory_cadence.py when the memory tier snapshots: `FixedCadence` (`memory_every N`) or
                      `AdaptiveCadence` (`auto`: within 2% of the step time).
    stragglers.py     each rank's compute time per step (step less collective waits), shared on
                      the per-step agreement; windowed median scores against the median rank.

The rank side never imports the agent side (`daemon/agent/`, `daemon/observe/`): it hears from
the daemon only through the run directory (`daemon/rundir/`). See the layering in
`daemon/__init__.py`.
"""
