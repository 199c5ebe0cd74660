"""The fork server's CUDA state after its imports: the last module the server imports.

Evaluated once, at import, in the fork server itself (`fork_server.py` puts this module last in
the server's preload list; no other process imports it). A forked child cannot tell by itself
whether its parent had initialized CUDA: torch's at-fork handler marks the child a "bad fork"
and `torch.cuda.is_initialized()` answers False there. So the server records the answers
before it forks anything, and the first forked process (`fork_server._probe`) reads the copies.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["CUDA_DRIVER_INITIALIZED", "CUDA_INITIALIZED"]

_CUDA_ERROR_NOT_INITIALIZED = 3
"""`cuDeviceGetCount`'s answer before `cuInit` (CUDA driver API, `CUresult`)."""


def _torch_cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _cuda_driver_initialized() -> bool:
    """Whether this process called `cuInit` (a job's `torch.cuda.is_available()` at import
    does, without initializing torch's CUDA state): a child forked after it cannot use CUDA."""
    try:
        # RTLD_NOLOAD: only a libcuda already loaded; loading it here would prove nothing.
        libcuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False  # never loaded: nothing can have initialized the driver
    count = ctypes.c_int()
    return bool(libcuda.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED)


CUDA_INITIALIZED = _torch_cuda_initialized()
"""torch's CUDA state was initialized in the server (`torch.cuda.is_initialized()`)."""
CUDA_DRIVER_INITIALIZED = _cuda_driver_initialized()
"""The CUDA driver was initialized in the server (`cuInit` was called)."""
