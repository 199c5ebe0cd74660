"""The per-run directory: the only channel between the daemon process and its ranks.

The daemon cannot call into its ranks and the ranks do not call the daemon; they share files in
one directory per run (`--run-dir`, else under `$RUNTIME_DIRECTORY` or the temp directory):

    <run_dir>/
      control/stop           exists once a stop was requested   (daemon writes, ranks poll)
      control/checkpoint     checkpoint request counter         (daemon writes, ranks poll)
      ranks/local-<k>.json   local rank k's snapshot            (rank writes, daemon reads)
      ranks/local-<k>.error.json  why local rank k failed       (rank writes, daemon reads)
      elastic/               the elastic agent's rank logs      (daemon only)

Module plan:
    control.py   stop / checkpoint requests: `request_stop`, `request_checkpoint`, `clear_stop`
                 (the daemon's side), `RankControl` (the rank's side, signals included).
    snapshot.py  the snapshot file: path, schema, atomic write, tolerant read.
    progress.py  the progress word: a rank's step and phase in a small mapped file, written at
                 every phase change (no system call), read by the daemon's hang detection.
    stacks.py    the ranks' stack dumps (faulthandler on SIGUSR2) and their parsing.
    failure.py   the rank error file: exception, step, phase, traceback tail, whether the job
                 or its configuration failed before training (the daemon's `agent/failures.py`).

CONTRACTS.md ("The daemon and its ranks") describes these files for readers of either side.
"""
