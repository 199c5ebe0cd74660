"""`ManagedParameter`: the parameters the engine puts into the wrapped module.

[Note: parameters outside forward] A managed parameter is a view of its bucket's compute
weights (`FlatBucket.full_param`). Under `OPTIM_GRADS_PARAMS` that storage is released
between uses, so outside forward the parameter has its shape but no memory; under the other
strategies it holds the whole current weight. Gradients never stay on parameters: the engine
takes them at the end of each unit's backward into its own buffers. So that plain torch code
cannot read freed memory or silently no-op, every torch call on a managed parameter is
checked (`__torch_function__`): metadata (shape, dtype, device, ...) always works; reading
or writing values raises `ParameterNotGatheredError` when the storage is released; touching
`.grad` always raises `GradientsInEngineError`. Autograd's backward runs in C++ and never
sees the checks.

[Note: parameters inside forward] Under `OPTIM_GRADS_PARAMS` the checks stay on inside the
wrapper's forward: a unit's weights are usable only from the moment its own gather has been
waited on until it is released (`Gate`), so forward code that reads the parameter of
another unit (released, or prefetched and still being gathered) raises
`ParameterNotGatheredError` instead of reading freed or half-written memory (and instead of
saving for backward a weight that will be freed before backward needs it). The cost is one
Python call per torch op that takes a parameter (BENCHMARKS.md has the figure). Under the
other strategies every weight is always whole, so the wrapper turns the checks off for its
forward (`engine_access`, one context per forward: no per-op cost).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch
from torch import nn

from sharding.errors import GradientsInEngineError, ParameterNotGatheredError

__all__ = ["Gate", "ManagedParameter", "engine_access"]

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


_run_plain = torch._C._disabled_torch_function_impl


def _check_all(values: Iterable[Any], func: Callable[..., Any]) -> None:
    for value in values:
        if isinstance(value, (list, tuple)):
            _check_all(value, func)
        elif (
            type(value) is ManagedParameter and not value._gate.open and not value._gate.try_open()
        ):
            _not_gathered(value, func)


def _not_gathered(param: ManagedParameter, func: Callable[..., Any]) -> NoReturn:
    raise ParameterNotGatheredError(
        f"parameter {param._name!r} of FSDP unit {param._gate.unit!r} is sharded at this "
        f"point (OPTIM_GRADS_PARAMS holds a unit's whole weights only while that unit runs) "
        f"and cannot be used by {getattr(func, '__name__', func)}: outside forward wrap the "
        f"code in `with model.summon_full_params():` (writeback=True to keep edits) or use "
        f"model.sharded_state_dict() / full_state_dict(); inside forward use a unit's "
        f"parameters only within that unit's own forward (or make the modules that share "
        f"them one unit, ShardingConfig.unit_modules)"
    )


class Gate:
    """Whether the parameters of one bucket may be used now (one object per bucket).

    Under `OPTIM_GRADS_PARAMS` it is open exactly while the bucket's unit is gathered and
    waited on (see the note above). Under `OPTIM` / `OPTIM_GRADS` it is closed only while
    the weight all-gather of the last optimizer step is pending; then `settle` waits on it
    and opens the gate, so a read waits instead of raising (see [Note: deferred weight
    gather] in `_optimizer.py`). Always open otherwise.
    """

    __slots__ = ("open", "settle", "unit")

    def __init__(self, unit: str) -> None:
        """A gate, open, for the parameters of `unit` (a name for error messages)."""
        self.open = True
        self.unit = unit
        self.settle: Callable[[], None] | None = None
        """Opens the gate by waiting on a pending weight gather (`None`: nothing to wait)."""

    def try_open(self) -> bool:
        """Open the gate if a pending gather can be waited on; whether it is open now."""
        if self.settle is not None:
            self.settle()
        return self.open


_ALWAYS_OPEN = Gate("")


class ManagedParameter(nn.Parameter):
    """An `nn.Parameter` whose memory the engine manages (see the note above).

    Outside forward under `OPTIM_GRADS_PARAMS`, use `FullyShardedDataParallel`'s
    `summon_full_params()` to read or edit whole weights; gradients are reached through the
    engine's optimizer (`optimizer.clip_grad_norm_`, `model.make_optimizer`).
    """

    _gate: Gate = _ALWAYS_OPEN
    _name: str = ""

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Check a torch call on managed parameters, then run it as on plain tensors."""
        if kwargs is None:
            kwargs = {}
        if func in _METADATA:
            return _run_plain(func, types, args, kwargs)
        if func in _GRAD:
            raise GradientsInEngineError(
                "gradients of a FullyShardedDataParallel model live in the engine, not on "
                "its parameters (.grad is not available): clip with the engine's "
                "optimizer.clip_grad_norm_(max_norm) and build the optimizer with "
                "model.make_optimizer(torch.optim.AdamW, ...), not on model.parameters()"
            )
        # Hot path inside ZeRO-3 forward: plain loops, no generator (BENCHMARKS.md).
        # `type() is`, not `isinstance`: Parameter's metaclass makes isinstance a Python call.
        for value in args:
            if type(value) is ManagedParameter:
                if not value._gate.open and not value._gate.try_open():
                    _not_gathered(value, func)
            elif isinstance(value, (list, tuple)):
                _check_all(value, func)
        if kwargs:
            _check_all(kwargs.values(), func)
        return _run_plain(func, types, args, kwargs)

    def attach(self, gate: Gate, name: str) -> None:
        """Bind the parameter to its bucket's `gate`; `name` is used in error messages."""
        with engine_access():
            empty = self.numel() == 0
        # An empty parameter has no memory to miss: it is always usable.
        self._gate = _ALWAYS_OPEN if empty else gate
        self._name = name
