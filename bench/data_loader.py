"""How long a training step waits for its data, local and on S3, and the loader's memory (#31).

- `data_wait_fraction_local` / `data_wait_fraction_s3`: the default GPT (`daemon.jobs.
  default_job.MODEL`) trains `--steps` steps on one CPU process (plain AdamW, no sharding: the
  data path is what is measured) from a byte-level token file (`TokenDataset`, read ahead by
  `PrefetchingLoader` with the daemon's default depth), on local disk and on a loopback S3
  server (SeaweedFS `weed mini`, range reads through the bounded block cache); the fraction is
  the total time `next_batch()` blocked over the total step time (target < 0.05);
- `loader_rss_mib_1e9`: in a fresh process, the peak RSS above the process's baseline (after
  imports) of a `ShardedLoader` over 10^9 virtual samples reading `--steps` batches (target
  <= 64 MiB; the former `randperm(n).tolist()` needed ~36 GB).

    .venv/bin/python bench/data_loader.py [--steps 40] [--batch-size 8] [--no-s3] [--json]
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import _common

_RSS_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import _common, torch
from daemon.rank.data import ShardedLoader

class Virtual:
    def __len__(self): return 10**9
    def __getitem__(self, i): return torch.tensor([i]), torch.tensor([i])

_common.reset_peak_rss()
baseline = _common.current_rss_bytes()
loader = ShardedLoader(Virtual(), batch_size=8, rank=0, world_size=1, seed=0)
for _ in range(int(sys.argv[2])):
    loader.next_batch()
print((_common.peak_rss_bytes() - baseline) / 2**20)
"""


def _loader_rss_mib(steps: int) -> float:
    bench_dir = str(pathlib.Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, bench_dir, str(steps)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def _train(source: str, options: dict[str, Any], steps: int, batch_size: int) -> dict[str, float]:
    import torch

    from daemon.data import TokenDataset
    from daemon.jobs.default_job import MODEL
    from daemon.jobs.gpt import GPT, lm_loss
    from daemon.rank.data import ShardedLoader
    from daemon.rank.prefetch import PrefetchingLoader

    torch.manual_seed(0)
    model = GPT(MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = TokenDataset([source], seq_len=MODEL.seq_len, storage_options=options)
    loader = ShardedLoader(dataset, batch_size=batch_size, rank=0, world_size=1, seed=0)
    waited = total = 0.0
    with PrefetchingLoader(loader, depth=2) as ahead:
        ahead.next_batch()  # the first batch: opening the file, not a steady-state step
        for _ in range(steps):
            start = time.perf_counter()
            inputs, targets = ahead.next_batch()
            got = time.perf_counter()
            loss = lm_loss(model(inputs), targets)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
            waited += got - start
            total += time.perf_counter() - start
    return {"wait_s": waited, "step_s": total, "fraction": waited / total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--no-s3", action="store_true", help="skip the SeaweedFS run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import numpy as np

    from daemon.data import write_token_file
    from daemon.jobs.default_job import corpus

    before = _common.machine_conditions()
    report: dict[str, Any] = {"steps": args.steps, "batch_size": args.batch_size}
    report["loader_rss_mib_1e9"] = _loader_rss_mib(args.steps)
    tokens = np.frombuffer(corpus(4_000_000), dtype=np.uint8)  # ~8 MB token file
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        local = f"{tmp}/train.bin"
        write_token_file(local, [tokens], vocab_size=256)
        got = _train(local, {}, args.steps, args.batch_size)
        report["local"] = got
        report["data_wait_fraction_local"] = got["fraction"]
        if not args.no_s3:
            from tests.support.seaweed import SeaweedS3

            server = SeaweedS3(pathlib.Path(tmp) / "weed", bucket="bench").start()
            try:
                options = dict(server.default_target().storage_options)
                remote = f"s3://bench/train-{int(time.time())}.bin"
                write_token_file(remote, [tokens], vocab_size=256, storage_options=options)
                got = _train(remote, options, args.steps, args.batch_size)
                report["s3"] = got
                report["data_wait_fraction_s3"] = got["fraction"]
            finally:
                server.stop()
    report["conditions"] = _common.conditions_line(before, _common.machine_conditions())
    if args.json:
        _common.print_json(report)
        return 0
    rows = [["loader RSS above baseline, 10^9 samples (MiB)", report["loader_rss_mib_1e9"], 64]]
    for where in ("local", "s3"):
        if where in report:
            rows.append([f"data wait / step time, {where}", report[where]["fraction"], 0.05])
    print(_common.markdown_table(["measure", "value", "target"], rows))
    print(report["conditions"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
