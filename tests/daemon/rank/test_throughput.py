"""MFU arithmetic against hand-computed values, the peak table, and the CPU's absent GPU series."""

from __future__ import annotations

import pytest
import torch

from daemon import GPT, GPTConfig
from daemon.jobs import default_job
from daemon.jobs.job import JobContext
from daemon.rank.throughput import (
    PEAK_FLOPS_BY_DEVICE,
    device_peak_flops,
    gpu_memory,
    mfu_ratio,
    peak_flops,
)


def test_default_gpt_flops_per_token_by_hand() -> None:
    # d=128, L=4, seq=64, V=256, tied head. Per block: ln1 2d + qkv 3d^2+3d + proj d^2+d
    # + ln2 2d + fc 4d^2+4d + out 4d^2+d = 12d^2 + 13d = 196608 + 1664 = 198272; 4 blocks
    # 793088; ln_f 2d = 256; head (tied token table) 256*128 = 32768; position table excluded.
    # N = 826112, 6N = 4956672; attention 12*L*d*seq = 12*4*128*64 = 393216.
    assert GPT(default_job.MODEL).flops_per_token() == 5_349_888.0
    job = default_job.build(JobContext(rank=0, world_size=1, seed=0))
    assert job.flops_per_token == 5_349_888.0


def test_an_untied_token_table_is_a_lookup_and_adds_no_flops() -> None:
    tied = GPT(GPTConfig(tie_embeddings=True)).flops_per_token()
    untied = GPT(GPTConfig(tie_embeddings=False)).flops_per_token()
    # Untied, the head is its own 256x128 matmul and the token table a lookup: same FLOPs.
    assert untied == tied


def test_mfu_ratio_by_hand() -> None:
    # 1000 tokens/s x 5,349,888 FLOPs/token = 5.349888e9 FLOP/s over a 1e12 peak.
    assert mfu_ratio(1000.0, 5_349_888.0, 1e12) == pytest.approx(0.005349888, rel=1e-12)
    # An H200 at 40% MFU on a 7e9-FLOPs/token model: 0.4 * 989e12 / 7e9 = 56514.3 tokens/s.
    assert mfu_ratio(56_514.2857, 7e9, 989e12) == pytest.approx(0.4, rel=1e-6)
    with pytest.raises(ValueError, match="peak FLOP/s must be positive"):
        mfu_ratio(1.0, 1.0, 0.0)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("Tesla T4", None),
    ],
)
def test_peak_table_matches_the_most_specific_name(name: str, expected: float | None) -> None:
    assert device_peak_flops(name) == expected


def test_every_table_entry_is_reachable() -> None:
    # An entry shadowed by an earlier, shorter name would never be used.
    for part, flops in PEAK_FLOPS_BY_DEVICE:
        assert device_peak_flops(f"NVIDIA {part}") == flops, part


def test_the_cpu_has_no_peak_unless_configured_and_no_gpu_series() -> None:
    cpu = torch.device("cpu")
    assert peak_flops(cpu, 0.0) is None
    assert peak_flops(cpu, 2e11) == 2e11
    assert gpu_memory(cpu) == {}
