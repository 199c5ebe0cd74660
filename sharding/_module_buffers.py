"""`ModuleBuffers`: the wrapped module's buffers, cast per policy and kept in sync per `BufferSync`.

At wrap, floating buffers are cast to their module's compute dtype (fp32 inside
`MixedPrecisionPolicy.fp32_modules`, e.g. BatchNorm running statistics; `param_dtype`
elsewhere; see [Note: mixed precision]), then rank 0's values are broadcast. Under
`BufferSync.BROADCAST` they are broadcast again before a forward that follows a training
forward, the rule of DDP's `broadcast_buffers=True`: the first forward after wrap, and any
forward after one that ran with grad enabled outside `no_sync`; one flat broadcast per dtype.
`full_state_dict` exports buffers in the dtypes they had before wrapping.

Non-persistent buffers (`register_buffer(..., persistent=False)`, e.g. the rotary `inv_freq`
of Hugging Face models) are cast and synchronised like the others but are never part of a
state dict: the module rebuilds them, exactly as `module.state_dict()` leaves them out, so
checkpoints, exports and `--init-from` sources hold `module.state_dict()`'s keys only.
"""

from __future__ import annotations

import torch
from torch import nn

from sharding._comm import Communicator
from sharding._config import BufferSync

__all__ = ["ModuleBuffers", "non_persistent_buffer_names"]


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Qualified names (every name of a shared one) of the buffers `state_dict()` leaves out."""
    return {
        f"{owner}.{attr}" if owner else attr
        for owner, sub in module.named_modules(remove_duplicate=False)
        for attr in sub._non_persistent_buffers_set
        if sub._buffers.get(attr) is not None
    }


class ModuleBuffers:
    """The buffers of one wrapped module (its engine's view of them)."""

    def __init__(
        self,
        module: nn.Module,
        dtypes: dict[str, torch.dtype],
        comm: Communicator,
        mode: BufferSync,
    ) -> None:
        """Cast floating buffers to `dtypes` (by qualified name) and broadcast rank 0's.

        Args:
            module: the wrapped module (its buffer attributes are replaced when cast).
            dtypes: target dtype of each floating buffer.
            comm: the data-parallel communicator.
            mode: when buffers are re-synchronised.
        """
        self._comm = comm
        self._mode = mode
        self.original_dtypes = {name: b.dtype for name, b in module.named_buffers()}
        """Dtype of each buffer before wrapping (what `full_state_dict` exports)."""
        cast: dict[int, torch.Tensor] = {}
        for name, buf in module.named_buffers(remove_duplicate=False):
            dtype = dtypes.get(name, buf.dtype)
            if buf.dtype == dtype:
                continue
            # A buffer registered under two names is cast once and stays shared.
            new = cast.setdefault(id(buf), buf.detach().to(dtype))
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._buffers[attr] = new
        self.by_name = dict(module.named_buffers())
        """Every buffer, by its first qualified name (after casting)."""
        self.non_persistent = non_persistent_buffer_names(module)
        """Names of the buffers `state_dict()` leaves out (rebuilt by the module, never saved)."""
        self.persistent = {n: b for n, b in self.by_name.items() if n not in self.non_persistent}
        """The buffers a state dict holds, by first qualified name."""
        self._sync_next = True
        self.broadcast()

    def broadcast(self) -> None:
        """Overwrite every rank's buffers with rank 0's (collective; not counted in stats)."""
        if not self._comm.distributed or not self.by_name:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buf in self.by_name.values():
            by_dtype.setdefault(buf.dtype, []).append(buf)
        with torch.no_grad():
            for bufs in by_dtype.values():
                flat = torch.cat([b.reshape(-1) for b in bufs])
                self._comm.broadcast_(flat)
                pos = 0
                for b in bufs:
                    b.copy_(flat[pos : pos + b.numel()].view_as(b))
                    pos += b.numel()

    def pre_forward(self) -> None:
        """Re-broadcast if the mode and DDP's rule say so (every rank calls forward)."""
        if self._mode is BufferSync.BROADCAST and self._sync_next:
            self.broadcast()

    def post_forward(self, *, trained: bool) -> None:
        """Note whether this forward was a training one (grad enabled, outside `no_sync`)."""
        self._sync_next = trained

    def exported(self) -> dict[str, torch.Tensor]:
        """Persistent buffers in their dtypes from before wrapping (copies where cast)."""
        return {
            name: buf
            if buf.dtype == self.original_dtypes[name]
            else buf.to(self.original_dtypes[name])
            for name, buf in self.persistent.items()
        }
