"""`ManagedParameter`: the parameters the engine puts into the wrapped module.

[Note: parameters outside forward] A managed parameter is a view of its bucket's compute
weights (`FlatBucket.full_param`). Under `OPTIM_GRADS_PARAMS` that storage is released
between uses, so outside forward the parameter has its shape but no memory; under the other
strategies it holds the whole current weight. Gradients never stay on parameters: the engine
takes them at the end of each unit's backward into its own buffers. So that plain torch code
cannot read freed memory or silently no-op, every torch call on a managed parameter is
checked (`__torch_function__`): metadata (shape, dtype, device, ...) always works; reading
or writing values raises `ParameterNotGatheredError` when the storage is released; touching
`.grad` always raises `GradientsInEngineError`. The wrapper turns the checks off for the
duration of its own forward (one context per forward, so no per-op cost where the engine is
in charge); autograd's backward runs in C++ and never sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sharding.errors import GradientsInEngineError, ParameterNotGatheredError

__all__ = ["ManagedParameter", "engine_access"]

engine_access = torch._C.DisableTorchFunctionSubclass
"""Context in which the engine itself touches managed parameters (no checks)."""

_T = torch.Tensor


def _descriptor(name: str) -> Any:
    """The C getset descriptor behind a tensor property (its `__get__` is what torch passes)."""
    return next(c.__dict__[name] for c in _T.__mro__ if name in c.__dict__)


_METADATA: set[Callable[..., Any]] = {
    _T.__hash__,
    _T.size,
    _T.dim,
    _T.numel,
    _T.nelement,
    _T.element_size,
    _T.stride,
    _T.storage_offset,
    _T.is_contiguous,
    _T.is_floating_point,
    _T.is_complex,
    _T.requires_grad_,
    _T.__len__,
}
for _name in (
    "shape",
    "dtype",
    "device",
    "requires_grad",
    "is_leaf",
    "grad_fn",
    "ndim",
    "layout",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "is_sparse",
    "is_quantized",
    "is_nested",
    "_version",
    "_base",
    "output_nr",
):
    _METADATA.add(_descriptor(_name).__get__)
_METADATA.add(_descriptor("requires_grad").__set__)
_GRAD = {_descriptor("grad").__get__, _descriptor("grad").__set__}


def _tensors(values: Iterable[Any]) -> Iterable[Any]:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


class ManagedParameter(nn.Parameter):
    """An `nn.Parameter` whose memory the engine manages (see the note above).

    Outside forward under `OPTIM_GRADS_PARAMS`, use `FullyShardedDataParallel`'s
    `summon_full_params()` to read or edit whole weights; gradients are reached through the
    engine's optimizer (`optimizer.clip_grad_norm_`, `model.make_optimizer`).
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Check a torch call on managed parameters, then run it as on plain tensors."""
        kwargs = kwargs or {}
        if func not in _METADATA:
            if func in _GRAD:
                raise GradientsInEngineError(
                    "gradients of a FullyShardedDataParallel model live in the engine, not on "
                    "its parameters (.grad is not available): clip with the engine's "
                    "optimizer.clip_grad_norm_(max_norm) and build the optimizer with "
                    "model.make_optimizer(torch.optim.AdamW, ...), not on model.parameters()"
                )
            with engine_access():
                for value in _tensors((*args, *kwargs.values())):
                    if (
                        isinstance(value, ManagedParameter)
                        and value.numel() > 0
                        and value.untyped_storage().nbytes() == 0
                    ):
                        raise ParameterNotGatheredError(
                            f"a parameter of shape {tuple(value.shape)} is sharded "
                            f"(OPTIM_GRADS_PARAMS releases whole weights outside forward) and "
                            f"cannot be used by {getattr(func, '__name__', func)}: wrap the code "
                            f"in `with model.summon_full_params():` (writeback=True to keep "
                            f"edits), or use model.sharded_state_dict() / full_state_dict()"
                        )
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
