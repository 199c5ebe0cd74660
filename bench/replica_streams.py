"""The replica path against a plain loopback copy, per number of connections (issue 29).

`bench/recovery.py`'s `replica_throughput_vs_loopback` with the daemon's default
`memory_replica_streams`; this runs the same measurement (`_recovery/machine.py`'s
`replica_path_vs_loopback`: a real memory-tier snapshot streamed by `ReplicaSender` to a
`ReplicaServer` on 127.0.0.1, each transfer right after a plain TCP copy of the same bytes)
for several stream counts, interleaved over `--repeats` passes so that a drift of the machine
falls on every count alike ([Note: replica payloads go over parallel streams] in
`daemon/agent/replica/stripes.py`).

    .venv/bin/python bench/replica_streams.py                      # 256 MiB, 1 / 2 / 4 streams
    .venv/bin/python bench/replica_streams.py --streams 1 4 --repeats 3 --json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys

import structlog
from _common import MIB, machine_conditions, markdown_table, print_json
from _recovery import machine, stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="snapshot size")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved passes")
    parser.add_argument("--rounds", type=int, default=6, help="transfers per stream count and pass")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if any(not 1 <= s <= 16 for s in args.streams):
        parser.error("--streams: each between 1 and 16 (memory_replica_streams' range)")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    before = machine_conditions()
    ratios: dict[int, list[float]] = {s: [] for s in args.streams}
    received: dict[int, list[float]] = {s: [] for s in args.streams}
    plain: dict[int, list[float]] = {s: [] for s in args.streams}
    for repeat in range(args.repeats):
        order = args.streams if repeat % 2 == 0 else list(reversed(args.streams))
        for streams in order:
            path = machine.replica_path_vs_loopback(args.mib * MIB, args.rounds, streams=streams)
            pairs = zip(path["receive_bytes_per_s"], path["loopback_bytes_per_s"], strict=True)
            for got, ref in pairs:
                ratios[streams].append(got / ref)
                received[streams].append(got)
                plain[streams].append(ref)
            print(f"pass {repeat}: {streams} stream(s) done", file=sys.stderr)
    report = {
        "bytes": args.mib * MIB,
        "per_streams": {
            str(s): {
                "ratio_vs_loopback": stats.spread(ratios[s]),
                "replica_bytes_per_s": statistics.median(received[s]),
                "loopback_bytes_per_s": statistics.median(plain[s]),
            }
            for s in args.streams
        },
        "machine_before": before,
        "machine_after": machine_conditions(),
    }
    if args.json:
        print_json(report)
        return 0
    rows = []
    for s in args.streams:
        spread = stats.spread(ratios[s])
        lo, hi = spread["median_ci95"]
        got, ref = statistics.median(received[s]), statistics.median(plain[s])
        ratio = f"{spread['median']:.2f} [{lo:.2f}-{hi:.2f}]"
        rows.append([str(s), ratio, f"{got / 1e9:.2f}", f"{ref / 1e9:.2f}"])
    print(
        markdown_table(
            ["streams", "replica / plain copy (median [95%])", "replica GB/s", "plain GB/s"], rows
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
