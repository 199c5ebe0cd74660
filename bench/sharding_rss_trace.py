"""Diagnostic: where the peak RSS of big_4r comes from, ours ZeRO-3 against torch FSDP2.

Trains the `big_4r` model of `bench/sharding_vs_torch.py` (GPT 4 blocks, d_model 1024, seq 32,
batch 1, 4 gloo ranks, fp32, AdamW, meta-device init on both sides) for `--steps` steps and
samples, at each engine event, this rank's resident set (`VmRSS`) and glibc's own view of
the heap (`mallinfo2`: bytes in use by live allocations, and how many of them are mmapped
chunks). RSS minus the bytes in use is memory malloc holds but nobody uses (free chunks of
the heap that were not given back: fragmentation).

Events, ours: all-gather issue / wait / release per unit, each reduction issued and finished,
a unit's backward finished (its gradients taken), optimizer step start / end. FSDP2 (its
internals are not ours to wrap): each Block's and the root's forward start / end and
backward start / end (module hooks), optimizer step start / end.

Output: per run, per rank, the peak VmRSS and the event it was sampled at; with `--timeline`
the whole event list of `--rank`. The bench's figures come from `VmHWM`; this samples at
events, so its maxima are a lower bound of the peak between events.

    .venv/bin/python bench/sharding_rss_trace.py --runs fsdp2,optim_grads_params --timeline
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
from typing import Any

import _common
from _common import MIB
from sharding_vs_torch import _wrap


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class _Sampler:
    """Samples (step, event, VmRSS, malloc in-use, mmapped) into a list."""

    def __init__(self) -> None:
        libc = ctypes.CDLL("libc.so.6")
        self._mallinfo2 = libc.mallinfo2
        self._mallinfo2.restype = _MallInfo2
        self.step = -1
        self.samples: list[tuple[int, str, int, int, int]] = []

    def __call__(self, event: str) -> None:
        info = self._mallinfo2()
        in_use = info.uordblks + info.hblkhd
        self.samples.append((self.step, event, _common.current_rss_bytes(), in_use, info.hblkhd))


def _wrap_method(obj: Any, name: str, sample: _Sampler, label: Any) -> None:
    """Sample after each call of `obj.name` (label: a function of the call's arguments)."""
    inner = getattr(obj, name)

    @functools.wraps(inner)
    def traced(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        sample(label(*args, **kwargs))
        return out

    setattr(obj, name, traced)


def _trace_ours(engine: Any, sample: _Sampler) -> None:
    gather = engine.gather
    _wrap_method(gather, "_issue", sample, lambda unit, **_: f"gather issued u{unit.index}")
    _wrap_method(gather, "wait", sample, lambda index: f"gather waited u{index}")
    _wrap_method(gather, "reshard", sample, lambda index: f"released u{index}")
    reduce = engine.reduce
    _wrap_method(
        reduce, "_push", sample, lambda *a, **k: f"reduce issued (in flight {len(reduce)})"
    )
    _wrap_method(
        reduce, "_pop_oldest", sample, lambda: f"reduce finished (in flight {len(reduce)})"
    )
    _wrap_method(engine, "_finish_unit", sample, lambda index: f"backward done u{index}")


def _trace_fsdp2(module: Any, sample: _Sampler) -> None:
    named = [(f"block{i}", b) for i, b in enumerate(module.blocks)] + [("root", module)]
    for name, sub in named:
        sub.register_forward_pre_hook(lambda *_, n=name: sample(f"forward start {n}"))
        sub.register_forward_hook(lambda *_, n=name: sample(f"forward end {n}"))
        sub.register_full_backward_pre_hook(lambda *_, n=name: sample(f"backward start {n}"))
        sub.register_full_backward_hook(lambda *_, n=name: sample(f"backward end {n}"))


def _rank_main(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from daemon import GPT, lm_loss

    _common.stdout_to_stderr()
    if spec["mmap_threshold"]:
        # M_MMAP_THRESHOLD (-3): a fixed threshold also turns glibc's dynamic one off.
        ctypes.CDLL("libc.so.6").mallopt(-3, spec["mmap_threshold"])
    sample = _Sampler()
    cfg = _common.tied_gpt_config(spec)
    torch.manual_seed(spec["seed"])
    with torch.device("meta"):
        module = GPT(cfg)
    sample("built (meta)")
    model, optimizer, engine = _wrap(spec["name"], module, 3e-4, 0.1, spec)
    sample("wrapped")
    if engine is not None:
        _trace_ours(engine._engine, sample)
    else:
        _trace_fsdp2(module, sample)
    torch_opt = optimizer.optimizer if engine is not None else optimizer
    torch_opt.register_step_pre_hook(lambda *_: sample("optimizer step start"))
    torch_opt.register_step_post_hook(lambda *_: sample("optimizer step end"))
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    batches = torch.randint(
        0, cfg.vocab_size, (spec["steps"], spec["batch"], cfg.seq_len + 1), generator=gen
    )
    for i in range(spec["steps"]):
        sample.step = i
        x, y = batches[i, :, :-1], batches[i, :, 1:]
        sample("step start")
        loss = lm_loss(model(x), y)
        sample("forward done")
        loss.backward()
        sample("backward done")
        optimizer.step()
        optimizer.zero_grad()
        sample("zero_grad done")
    return {"samples": sample.samples, "hwm": _common.peak_rss_bytes()}


def main(argv: list[str] | None = None) -> int:
    """Run each selected run on 4 ranks and print its peaks (and the timeline)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", default="fsdp2,optim_grads_params")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=0,
        help="diagnostic: mallopt(M_MMAP_THRESHOLD) in every rank of every run (0: glibc's)",
    )
    p.add_argument("--rank", type=int, default=0, help="rank whose timeline is printed")
    p.add_argument("--timeline", action="store_true", help="print every event of --rank")
    args = p.parse_args(argv)
    for run in args.runs.split(","):
        spec = {
            "name": run,
            "layers": 4,
            "d_model": args.d_model,
            "heads": max(1, args.d_model // 64),
            "seq_len": args.seq_len,
            "batch": 1,
            "steps": args.steps,
            "seed": 0,
            "dtype": "fp32",
            "meta_init": True,
            "mmap_threshold": args.mmap_threshold,
        }
        ranks = _common.run_ranks(_rank_main, 4, spec, timeout_s=900.0)
        print(f"== {run}")
        for r, out in enumerate(ranks):
            top = max(out["samples"], key=lambda s: s[2])
            print(
                f"rank {r}: VmHWM {out['hwm'] / MIB:.0f} MiB; max sampled VmRSS "
                f"{top[2] / MIB:.0f} MiB at step {top[0]} '{top[1]}' (malloc in use "
                f"{top[3] / MIB:.0f}, of it mmapped {top[4] / MIB:.0f})"
            )
        if args.timeline:
            print("step | event | VmRSS MiB | malloc in use MiB | mmapped MiB | RSS - in use")
            for step, event, rss, in_use, mapped in ranks[args.rank]["samples"]:
                print(
                    f"{step} | {event} | {rss / MIB:.0f} | {in_use / MIB:.0f} | "
                    f"{mapped / MIB:.0f} | {(rss - in_use) / MIB:.0f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
