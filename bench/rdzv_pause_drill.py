"""Drill: node 0's daemon (the c10d store's host) SIGSTOPped for 90 s under a two-node job.

Issue 32 (item 2), as the issue states it: two daemons on 127.0.0.1 (`--nnodes 2
--nproc-per-node 1`, one checkpoint root, torch's default store timeout of 60 s and the
default `rdzv_store_grace_s` of 120 s), the default job training without any gate. Once the
run has committed a checkpoint, node 0's daemon is SIGSTOPped for `--pause-s` (its ranks and
node 1 go on), then continued. Verdict lines: both daemons exit 0, the ranks committed
checkpoints *during* the pause (training went on), node 1 never restarted its ranks, and no
traceback reached either daemon's stderr. Too long for the suite (the suite pauses the store
for several 3 s store timeouts: `tests/daemon/agent/test_store_outage.py`).

    .venv/bin/python bench/rdzv_pause_drill.py                 # 90 s pause
    .venv/bin/python bench/rdzv_pause_drill.py --pause-s 30 --max-steps 800
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))

from tests.daemon._daemon_proc import DaemonProc, committed_steps, wait_for
from tests.support.dist import free_port


def _committed(root: Path) -> list[int]:
    """Committed steps under `root` ([] before the root exists)."""
    try:
        return committed_steps(root)
    except Exception:  # no root yet: ckptctl says so and exits 1
        return []


def _tracebacks(node: DaemonProc) -> int:
    lines = node.stderr_path.read_text(errors="replace").splitlines()
    return sum(1 for line in lines if line.startswith("Traceback"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pause-s", type=float, default=90.0)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rdzv-pause-drill-"))
    root = work / "ckpt"
    endpoint = f"127.0.0.1:{free_port()}"
    nodes: list[DaemonProc] = []
    for k in (1, 0):
        flags = [
            "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1",
            "--rdzv-endpoint", endpoint, "--max-steps", str(args.max_steps),
            "--ckpt-uri", str(root), "--ckpt-every", str(args.ckpt_every),
            "--strategy", "no_shard", "--device", "cpu",
        ]  # fmt: skip
        nodes.append(DaemonProc(work, flags, name=f"node{k}"))
    node1, node0 = nodes
    report: dict[str, object] = {"pause_s": args.pause_s, "workdir": str(work)}
    try:
        wait_for(lambda: _committed(root), 300, "a first committed checkpoint")
        before = _committed(root)[-1]
        node0.signal(signal.SIGSTOP)
        paused = time.monotonic()
        time.sleep(args.pause_s)
        during = _committed(root)[-1]
        alive = node1.exit_code() is None
        node0.signal(signal.SIGCONT)
        report.update(
            newest_committed_at_pause=before,
            newest_committed_at_continue=during,
            steps_committed_during_pause=during - before,
            node1_alive_during_pause=alive,
            paused_for_s=round(time.monotonic() - paused, 1),
        )
        codes = [node0.wait(1800), node1.wait(1800)]
        outages = node1.find("rendezvous_store_unreachable")
        report.update(
            exit_codes=codes,
            final_committed=_committed(root)[-1],
            node1_rank_starts=len(node1.find("training")),
            node0_rank_starts=len(node0.find("training")),
            node1_store_outages=len(outages),
            node1_store_back=[e.get("outage_s") for e in node1.find("rendezvous_store_back")],
            tracebacks=_tracebacks(node0) + _tracebacks(node1),
        )
    finally:
        for node in nodes:
            if node.exit_code() is None:
                node.signal(signal.SIGCONT)
                node.signal(signal.SIGKILL)
    ok = (
        report.get("exit_codes") == [0, 0]
        and int(str(report.get("steps_committed_during_pause", 0))) > 0
        and report.get("node1_rank_starts") == 1
        and report.get("tracebacks") == 0
        and report.get("final_committed") == args.max_steps
    )
    report["verdict"] = "PASS" if ok else "FAIL"
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
