"""Errors raised by the sharding engine.

```
ShardingError (RuntimeError)                    base of everything the engine raises itself
├── DeviceMismatchError (+ ValueError)          a module tensor is not on the engine's device
├── MixedPrecisionError (+ ValueError)          the policy would recast a dtype the user chose
├── DeferredInitError (+ ValueError)            a meta-device model cannot be materialized
├── UnwrappedModuleError                        the inner module ran outside the wrapper
├── ParameterNotGatheredError                   a ZeRO-3 parameter was used while sharded
├── GradientsInEngineError                      `.grad` of a managed parameter was touched
└── StateDictLayoutError (+ ValueError)         a loaded state dict does not fit this engine
```

Configuration mistakes raise plain `ValueError` from `ShardingConfig.__post_init__`.
"""

from __future__ import annotations

__all__ = [
    "DeferredInitError",
    "DeviceMismatchError",
    "GradientsInEngineError",
    "MixedPrecisionError",
    "ParameterNotGatheredError",
    "ShardingError",
    "StateDictLayoutError",
    "UnwrappedModuleError",
]


class ShardingError(RuntimeError):
    """Base class of the sharding engine's errors."""


class DeviceMismatchError(ShardingError, ValueError):
    """A parameter or buffer of the wrapped module is not on the engine's device."""


class MixedPrecisionError(ShardingError, ValueError):
    """The mixed-precision policy would silently recast parameters the user kept in a dtype.

    The message names the module; keep it with `MixedPrecisionPolicy.fp32_modules`, choose
    `param_dtype` to match, or convert the module before wrapping.
    """


class DeferredInitError(ShardingError, ValueError):
    """A model built on the meta device cannot be materialized and initialized as asked.

    E.g. only part of it is on `meta`, or a parameter or buffer is left unwritten by
    `reset_parameters()` / `DeferredInit.init_fn` (the message names it).
    """


class UnwrappedModuleError(ShardingError):
    """The inner module ran forward or produced gradients without going through the wrapper."""


class StateDictLayoutError(ShardingError, ValueError):
    """A state dict's keys, shapes or shard layout do not match this engine."""


class ParameterNotGatheredError(ShardingError):
    """A parameter was read or written while `OPTIM_GRADS_PARAMS` holds only its shard.

    Use `FullyShardedDataParallel.summon_full_params()` for whole weights outside forward.
    """


class GradientsInEngineError(ShardingError):
    """`.grad` of a managed parameter was read or set; the engine owns gradients.

    Use `DistributedOptimizer.clip_grad_norm_` and `FullyShardedDataParallel.make_optimizer`.
    """
