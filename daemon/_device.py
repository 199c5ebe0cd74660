"""Which device a rank trains on: the `device` setting resolved against this node's CUDA.

`auto` picks CUDA when torch sees a GPU, else the CPU; `cuda` insists on it. On CUDA, local
rank `r` owns GPU `r` (`torch.cuda.set_device`), the training process group is NCCL and the
checkpoint manager keeps its own gloo group for its CPU-side agreement (see
`ckpt_manager/_coord.py`). `trainingd run` checks the setting before any rank starts
(`cuda_problem`, via `daemon/agent/preflight.py`), so a node without CUDA fails with exit code 2 and
one line instead of a rank traceback.
"""

from __future__ import annotations

import torch

from daemon.config import Device

__all__ = ["cuda_problem", "process_group_backend", "resolve_device"]


def cuda_problem(setting: Device, nproc_per_node: int) -> str | None:
    """Why `setting` cannot run `nproc_per_node` ranks on this node, as one line (None: it can).

    Args:
        setting: the configured device.
        nproc_per_node: rank processes this node starts (one GPU each on CUDA).
    """
    if setting is Device.CPU:
        return None
    available = torch.cuda.is_available()
    if setting is Device.CUDA and not available:
        built = torch.version.cuda
        why = (
            f"torch {torch.__version__} was built without CUDA"
            if built is None
            else ("torch sees no GPU (check the driver and CUDA_VISIBLE_DEVICES)")
        )
        return f"device=cuda: CUDA is not available on this node ({why}); use --device cpu or auto"
    if available and torch.cuda.device_count() < nproc_per_node:
        count = torch.cuda.device_count()
        return (
            f"device={setting.value}: nproc_per_node={nproc_per_node} needs one GPU per rank, "
            f"this node has {count}; set --nproc-per-node {count} (or --device cpu)"
        )
    return None


def resolve_device(setting: Device, local_rank: int) -> torch.device:
    """The device of local rank `local_rank`: `cuda:<local_rank>` or `cpu`.

    Raises:
        RuntimeError: `setting` is `cuda` and torch sees no GPU `local_rank`.
    """
    if setting is Device.CPU or (setting is Device.AUTO and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"device={setting.value}: local rank {local_rank} has no GPU "
            f"({torch.cuda.device_count()} visible); use --device cpu"
        )
    return torch.device("cuda", local_rank)


def process_group_backend(device: torch.device) -> str:
    """The training group's backend on `device`: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"
