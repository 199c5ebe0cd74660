"""The daemon process: one per node, it launches the local ranks and watches them.

Module plan:
    run.py          `trainingd run` from start-up checks to exit code: HTTP server, signals,
                    supervisor, elastic agent; the exit codes.
    preflight.py    start-up checks (job importable, storage reachable and writable, lease free,
                    the device available, `--init-from` fits) -> exit 2.
    root_checks.py  a node of a multi-node job checks the checkpoint root in the job's first
                    round only (a node joining a running job reads nothing from storage).
    memory_dir.py   the node's memory-tier directory (tmpfs): claimed with an owner record at
                    start, this run's stale ones reclaimed, removed at every exit.
    semaphores.py   the named semaphores torch made for the ranks, recorded in that directory
                    for a successor to unlink after a group SIGKILL.
    memory_budget.py  the memory tier's start-up budget line; exit 2 or durable-only if unfit.
    elastic.py      the elastic agent in membership rounds: shrink and grow (`MIN:MAX`);
                    the rendezvous on c10d (node 0's store) or etcd-v2 (an etcd server).
    store_guard.py  rendezvous-store outages ridden out within `rdzv_store_grace_s`; past it,
                    or with the store's host gone, exit 75 with one line.
    rdzv_delegate.py  the rendezvous-handler pass-through the agent's wrappers (membership
                    watch, wait-list throttle, store guard) build on.
    rdzv_poll.py    a node waiting in a rendezvous reads its state every `max_nodes` x 20 ms
                    (50 ms to torch's 1 s), not once a second from a 1 s cache.
    replica/        peer replicas of the memory tier: a server, a sender to the next node
                    (node ring), the fetch of a lost node's snapshots before its ranks start.
    fork_server.py  warm rank starts: ranks fork from a server that imported torch and the
                    job (never CUDA, no threads) once per daemon, checked on a first fork.
    _server_state.py  imported last by that server: its CUDA state after its imports.
    supervisor.py   supervisor thread: node phase and readiness, sd_notify, orphan reaping,
                    shutdown budget, progress.
    hang.py         hang detection: a rank whose progress word stops past its budget is named
                    (stopped, or its innermost frame from a stack dump) and its group killed.
    failures.py     rank failures: classified (config, exception, oom, signal, exit code, hung),
                    logged, counted, shown; the same error at the same step twice (exit 1) or
                    the job's own failure before training (exit 2) ends the retries.
    scrapes.py      when `/metrics` was read; the wait for one scrape of a finished run.
    straggler.py    the straggler watch: a rank whose exported score reaches the threshold is
                    named (`rank_straggler`), optionally its group killed.
    incident_watch.py  a failed attempt declared as one incident; a restart seen through to
                    its first step (recovery time, restored step, restore source).
    http.py         one port: `/`, `/api/status`, `/metrics`, `/healthz`, `/readyz`.
    scrapes.py      scrapes of `/metrics`; the wait for one read of a finished run.
    status_page.py  the status page's HTML (one file, no build step).
    progress.py     the live status line on a terminal, `progress` log events off it.
    relay.py        on a terminal: the ranks' output, redirected to files, printed by the daemon.
    notify.py       sd_notify over a datagram socket (no dependency); `TimeoutExtender`:
                    EXTEND_TIMEOUT_USEC only after progress.

The agent never imports the rank side (`daemon/rank/`, `daemon/worker.py`): it is handed the
rank entry point by `daemon/cli.py` and talks to the ranks through the run directory
(`daemon/rundir/`). See the layering in `daemon/__init__.py`.
"""
