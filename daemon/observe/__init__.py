"""What the daemon process knows about its node and reports: state, metrics, status.

Module plan:
    state.py      `NodeState` / `NodePhase`: starting -> rendezvous -> loading -> training
                  <-> checkpointing; any -> draining -> stopped.
    collector.py  the rank snapshots read at scrape time (`SnapshotAggregator`, `RankView`) and
                  the Prometheus collector of `daemon.metrics.CATALOG` (`NodeCollector`).
    status.py     `StatusBoard`: what the status page and `/api/status` show (loss history,
                  rates, ETA, committed checkpoints, hangs, last error).
    hangs.py      `HangLedger`: the hangs the agent's detector declared (hung ranks, hangs per
                  rank, the last hang), read by the collector and the status board.
    stragglers.py `StragglerLedger`: the stragglers the agent's watch named (now, episodes per
                  rank, the newest episodes), read by the collector and the status board.
    incidents.py  `IncidentLog`: one record per fault (what, where, detection and recovery
                  seconds, steps lost, restore source, state), `<run_dir>/incidents.jsonl`.
    report.py     `trainingd status`: a daemon's `/api/status` (or its run directory's files)
                  as a human summary.

Read by the agent's HTTP server, supervisor and progress sinks (`daemon/agent/`) and by
`trainingd status` (`daemon/cli.py`); it imports no agent module, and nothing of the rank
side: ranks reach it only through their snapshot files (`daemon/rundir/snapshot.py`).
"""
