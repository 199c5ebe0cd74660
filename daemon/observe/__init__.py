"""What the daemon process knows about its node and reports: state, metrics, status.

Module plan:
    state.py      `NodeState` / `NodePhase`: starting -> rendezvous -> loading -> training
                  <-> checkpointing; any -> draining -> stopped.
    collector.py  the rank snapshots read at scrape time (`SnapshotAggregator`, `RankView`) and
                  the Prometheus collector of `daemon.metrics.CATALOG` (`NodeCollector`).
    status.py     `StatusBoard`: what the status page and `/api/status` show (loss history,
                  rates, ETA, committed checkpoints, last error).

Read by the agent's HTTP server, supervisor and progress sinks (`daemon/agent/`); it imports
no agent module, and nothing of the rank side: ranks reach it only through their snapshot files
(`daemon/rundir/snapshot.py`).
"""
