"""Per-rank speed and device figures: tokens/s, model FLOPs utilisation, CUDA memory.

[Note: MFU] `trainingd_train_mfu_ratio` = tokens/s x model FLOPs per token / peak FLOP/s of
one device. FLOPs per token come from the job (`JobSpec.flops_per_token`; the default GPT's
`6 N + 12 L d seq`, see `GPT.flops_per_token`), so recomputation (activation checkpointing)
does not count: it is *model* FLOPs, comparable across runs and with published MFUs. The peak
is the configured `peak_flops`, else the bf16 dense tensor-core peak of the GPU from
`PEAK_FLOPS_BY_DEVICE` (NVIDIA datasheets; the SXM part unless the name says otherwise). A
rank's tokens/s is its own tokens over the step's wall time, which covers the GPU's work: the
step ends with its one host read (see [Note: one host read per step] in `daemon/rank/loop.py`).
No table entry and nothing configured (the CPU, an unknown GPU): no MFU is exported rather
than a made-up one.
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_FLOPS_BY_DEVICE", "device_peak_flops", "gpu_memory", "mfu_ratio", "peak_flops"]

PEAK_FLOPS_BY_DEVICE: tuple[tuple[str, float], ...] = (
    # First match wins: longer names before the names they contain ("GH200" holds "H200",
    # "A100" holds "A10", "L40S" holds "L4").
    ("B200", 2.25e15),
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10", 125e12),
)
"""`(substring of torch.cuda.get_device_name(), bf16 dense peak FLOP/s)`, first match wins."""


def device_peak_flops(device_name: str) -> float | None:
    """The table's peak FLOP/s for a device called `device_name` (None: not in the table)."""
    for part, flops in PEAK_FLOPS_BY_DEVICE:
        if part in device_name:
            return flops
    return None


def peak_flops(device: torch.device, configured: float) -> float | None:
    """Peak FLOP/s of one `device`: `configured` if positive, else the table's (CUDA only)."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    return device_peak_flops(torch.cuda.get_device_name(device))


def mfu_ratio(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over `peak` (see [Note: MFU])."""
    if peak <= 0:
        raise ValueError(f"peak FLOP/s must be positive, got {peak}")
    return tokens_per_s * flops_per_token / peak


def gpu_memory(device: torch.device) -> dict[str, float]:
    """The caching allocator's figures for `device` as `{metric name: bytes}` (empty off CUDA).

    These are host-side counters of the allocator: reading them does not wait for the GPU.
    """
    if device.type != "cuda":
        return {}
    return {
        "trainingd_gpu_memory_allocated_bytes": float(torch.cuda.memory_allocated(device)),
        "trainingd_gpu_memory_reserved_bytes": float(torch.cuda.memory_reserved(device)),
        "trainingd_gpu_memory_max_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
    }
