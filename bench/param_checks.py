"""Forward cost of the ManagedParameter checks that ZeRO-3 keeps on inside forward.

Under `OPTIM_GRADS_PARAMS` every torch call that takes a parameter goes through
`ManagedParameter.__torch_function__` during forward, which raises `ParameterNotGatheredError`
when a unit's weights are not gathered ([Note: parameters inside forward] in
`sharding/_param.py`). This bench trains one rank (world size 1, ZeRO-3, Block units) and
times forward with the checks (the engine as shipped) and without them (the same forward
inside `engine_access()`, which turns them off), in interleaved rounds: each round runs
`--steps` training steps per setting, the forward of each step timed alone. It prints the
median forward time of each setting, their ratio (checks / none, pooled over rounds), the
spread of the per-round ratios, the checked calls per forward, the overhead of one checked
call (timed in a tight loop) and the ratio it implies (`estimated_ratio`: 1 + calls x
overhead / forward time), which other load on the machine moves much less.

    .venv/bin/python bench/param_checks.py                        # the default job's GPT
    .venv/bin/python bench/param_checks.py --d-model 512 --batch 16   # a wider model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import _common
from _common import median


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from daemon import GPT, Block, GPTConfig, lm_loss
    from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
    from sharding._param import ManagedParameter, engine_access

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(
        seq_len=args.seq_len, num_layers=args.num_layers, num_heads=4, d_model=args.d_model
    )
    model = FullyShardedDataParallel(
        GPT(cfg),
        ShardingConfig(strategy=Strategy.OPTIM_GRADS_PARAMS, unit_modules=(Block,)),
    )
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len))

    def step(checks: bool) -> float:
        start = time.perf_counter()
        with contextlib.nullcontext() if checks else engine_access():
            out = model(x)
        forward_s = time.perf_counter() - start
        lm_loss(out, y).backward()
        opt.step()
        opt.zero_grad()
        return forward_s

    # Checked calls per forward: count them once through a counting subclass hook.
    calls = 0
    original = ManagedParameter.__torch_function__

    def counting(cls: Any, func: Any, types: Any, a: Any = (), kw: Any = None) -> Any:
        nonlocal calls
        calls += 1
        return original.__func__(cls, func, types, a, kw)  # type: ignore[attr-defined]

    ManagedParameter.__torch_function__ = classmethod(counting)  # type: ignore[assignment,method-assign]
    step(True)
    ManagedParameter.__torch_function__ = original  # type: ignore[method-assign]
    for _ in range(args.warmup):
        step(True)
        step(False)
    times: dict[bool, list[float]] = {True: [], False: []}
    round_ratios = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {c: [step(c) for _ in range(args.steps)] for c in order}
        for c in order:
            times[c] += got[c]
        round_ratios.append(median(got[True]) / median(got[False]))
    on, off = median(times[True]), median(times[False])
    per_call_s = _per_call_overhead_s(ManagedParameter, engine_access)
    return {
        "model": f"GPT d_model={args.d_model} layers={args.num_layers} seq={args.seq_len}",
        "batch": args.batch,
        "forward_s_checks": on,
        "forward_s_no_checks": off,
        "ratio": on / off,
        "round_ratio_min": min(round_ratios),
        "round_ratio_max": max(round_ratios),
        "checked_calls_per_forward": calls,
        "per_call_overhead_us": per_call_s * 1e6,
        "estimated_ratio": 1 + calls * per_call_s / off,
        "machine": _common.machine_conditions(),
    }


def _per_call_overhead_s(managed: Any, engine_access: Any) -> float:
    """Extra time of one checked call: a 4x4 `linear` on a managed vs a plain parameter.

    The op is tiny, so the difference is the check (Python `__torch_function__` dispatch
    and the gate test). Short loops of each, interleaved, and the fastest of each kept:
    other load only ever adds time, so the minima stay meaningful on a busy machine.
    """
    import torch

    param = managed(torch.randn(4, 4))
    x = torch.randn(1, 4)
    linear = torch.nn.functional.linear
    best = {True: float("inf"), False: float("inf")}
    for _ in range(30):
        for checks in (True, False):
            with contextlib.nullcontext() if checks else engine_access():
                start = time.perf_counter()
                for _ in range(3000):
                    linear(x, param)
                best[checks] = min(best[checks], (time.perf_counter() - start) / 3000)
    return best[True] - best[False]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="steps per setting per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    print(json.dumps(_run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
