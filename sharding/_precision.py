"""`MixedPrecisionPolicy` and how the wrapper applies it: compute dtypes, casts, checks.

[Note: mixed precision] Four dtypes matter, after FSDP2 and Megatron-Core:
* main weights, optimizer state and accumulated gradients: always fp32 (the engine's);
* compute weights (`param_dtype`): what forward and backward run in. Parameters of the
  outermost instances of `fp32_modules` (BatchNorm by default, as FSDP1 does: cuDNN wants
  fp32 scale and shift, and running statistics averaged over thousands of steps need fp32)
  and everything inside them stay fp32; such a module casts its floating inputs to fp32 and
  its floating outputs back to the dtype its first floating input had, so it fits between
  `param_dtype` layers. LayerNorm/RMSNorm follow `param_dtype` by default (torch's kernels
  accumulate in fp32 anyway, as FSDP2 and Megatron run them); list them to keep them fp32;
* gradient communication (`reduce_dtype`): each bucket is packed, pre-divided and reduced
  in it, then added into the fp32 main gradient; bf16 halves the bytes on the wire. It
  applies to every bucket, fp32 modules' included (their gradients are tiny; one rule keeps
  the byte count exactly half);
* outputs (`output_dtype`): the wrapper's floating outputs are cast to it (e.g. fp32 logits
  for the loss); `None` leaves them as computed.

Floating-point inputs of the wrapper and of every FSDP unit are cast to `param_dtype`
(`cast_forward_inputs`), so float features meet bf16 weights in bf16; integer inputs (token
ids) are untouched. Floating buffers are cast like parameters (fp32 inside `fp32_modules`),
except non-persistent ones (rotary frequencies, masks: rebuilt constants, not state), which
stay in fp32.

A parameter is never silently recast away from a dtype the user chose
(`check_stored_dtypes`, else `MixedPrecisionError` naming the module): a parameter stored in
bf16/fp16 must compute in that dtype (or be upcast by `fp32_modules`); and where the model is
stored in mixed dtypes, its fp32 parameters were kept in fp32 on purpose, so they must be in
`fp32_modules` rather than be lowered to `param_dtype`. An all-fp32 model is simply cast.

fp16 (compute or reduce) needs `loss_scale=DynamicLossScale()`: without loss scaling its
small gradients underflow to zero silently (bf16 has fp32's exponent range and needs none).
The sharded scaler (`_scaler.py`) multiplies the loss (`optimizer.scale_loss(loss)`), checks
every rank's gradient shards for inf/NaN in one all-reduce, skips the step and backs the scale
off on overflow, and grows it after `growth_interval` clean steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map

from sharding.errors import MixedPrecisionError

__all__ = [
    "DynamicLossScale",
    "MixedPrecisionPolicy",
    "cast_floating",
    "check_stored_dtypes",
    "compute_dtypes",
    "fp32_module_ids",
    "keep_fp32",
]

_LOW = (torch.bfloat16, torch.float16)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP16_NEEDS_SCALER = (
    "float16 needs loss scaling (its small gradients underflow to zero silently without "
    "it): also pass loss_scale=DynamicLossScale() and train with "
    "optimizer.scale_loss(loss).backward(), or use torch.bfloat16 (no scaler needed)"
)


@dataclasses.dataclass(kw_only=True, frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling for fp16 (as `torch.amp.GradScaler` and Megatron's scaler).

    The loss is multiplied by the scale before backward; a step whose gradients (any shard,
    any rank) hold inf/NaN is skipped and the scale multiplied by `backoff_factor`; after
    `growth_interval` clean steps in a row it is multiplied by `growth_factor`.
    """

    init_scale: float = 2.0**16
    """Scale of the first step."""
    growth_factor: float = 2.0
    """Factor (> 1) applied after `growth_interval` steps without overflow."""
    backoff_factor: float = 0.5
    """Factor (in (0, 1)) applied on overflow (the step is skipped)."""
    growth_interval: int = 2000
    """Clean steps in a row before the scale grows."""
    min_scale: float = 1.0
    """The scale never backs off below this."""

    def __post_init__(self) -> None:
        if not (0.0 < self.init_scale < float("inf")):
            raise ValueError(
                f"DynamicLossScale.init_scale must be positive and finite, got {self.init_scale}"
            )
        if not self.growth_factor > 1.0:
            raise ValueError(
                f"DynamicLossScale.growth_factor must be > 1, got {self.growth_factor}"
            )
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(
                f"DynamicLossScale.backoff_factor must be in (0, 1), got {self.backoff_factor}"
            )
        if self.growth_interval < 1:
            raise ValueError(
                f"DynamicLossScale.growth_interval must be >= 1, got {self.growth_interval}"
            )
        if not 0.0 < self.min_scale <= self.init_scale:
            raise ValueError(
                f"DynamicLossScale.min_scale must be in (0, init_scale={self.init_scale}], "
                f"got {self.min_scale}"
            )


@dataclasses.dataclass(kw_only=True, frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes the engine computes, communicates and returns in (see the note above).

    Main weights, optimizer state and gradient accumulation are fp32 whatever the policy.

    Example:
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                             output_dtype=torch.float32,
                             fp32_modules=(nn.LayerNorm, nn.BatchNorm1d))
    """

    param_dtype: torch.dtype = torch.float32
    """Compute dtype of the model weights: `torch.float32`, `torch.bfloat16`, or
    `torch.float16` (with `loss_scale`)."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are reduce-scattered / all-reduced in (`torch.float32`;
    `torch.bfloat16` halves the bytes; `torch.float16` with `loss_scale`); they accumulate
    into fp32 main gradients either way."""
    output_dtype: torch.dtype | None = None
    """Dtype the wrapper's floating-point outputs are cast to; `None` leaves them as computed."""
    cast_forward_inputs: bool = True
    """Cast floating-point tensors among the wrapper's and each unit's forward arguments to
    `param_dtype` (integer tensors such as token ids are untouched)."""
    fp32_modules: tuple[type[nn.Module], ...] = (_BatchNorm,)
    """Module classes whose instances (and everything inside them) compute and keep floating
    buffers in fp32; they cast floating inputs to fp32 and outputs back to the input's dtype.
    Default: every BatchNorm (and SyncBatchNorm)."""
    loss_scale: DynamicLossScale | None = None
    """Dynamic loss scaling (required with float16); `None`: no scaling."""

    def __post_init__(self) -> None:
        if self.loss_scale is not None and not isinstance(self.loss_scale, DynamicLossScale):
            raise ValueError(
                "MixedPrecisionPolicy.loss_scale must be a sharding.DynamicLossScale or None, "
                f"got {self.loss_scale!r}"
            )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in _DTYPES:
                raise ValueError(
                    f"MixedPrecisionPolicy.{name} must be torch.float32, torch.bfloat16 or "
                    f"torch.float16, got {value!r}"
                )
            if value == torch.float16 and self.loss_scale is None:
                raise ValueError(f"MixedPrecisionPolicy.{name}=torch.float16: {_FP16_NEEDS_SCALER}")
        out = self.output_dtype
        if out is not None and not (isinstance(out, torch.dtype) and out.is_floating_point):
            raise ValueError(
                "MixedPrecisionPolicy.output_dtype must be a floating-point torch.dtype "
                f"(e.g. torch.float32) or None to leave outputs as computed, got {out!r}"
            )
        if not isinstance(self.fp32_modules, tuple) or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in self.fp32_modules
        ):
            raise ValueError(
                "MixedPrecisionPolicy.fp32_modules must be a tuple of nn.Module subclasses "
                f"(e.g. (nn.LayerNorm,)), got {self.fp32_modules!r}"
            )


def _fp32_roots(module: nn.Module, policy: MixedPrecisionPolicy) -> list[tuple[str, nn.Module]]:
    """Outermost instances of `policy.fp32_modules` (name, module), pre-order."""
    roots: list[tuple[str, nn.Module]] = []
    if not policy.fp32_modules:
        return roots
    for name, sub in module.named_modules():
        if not isinstance(sub, policy.fp32_modules):
            continue
        if any(name == r or name.startswith(r + ".") or r == "" for r, _ in roots):
            continue
        roots.append((name, sub))
    return roots


def fp32_module_ids(module: nn.Module, policy: MixedPrecisionPolicy) -> set[int]:
    """`id` of every module that computes in fp32 (the `fp32_modules` roots and their insides)."""
    return {id(m) for _, root in _fp32_roots(module, policy) for m in root.modules()}


def _in_fp32(name: str, roots: list[str]) -> bool:
    return any(r == "" or name.startswith(r + ".") for r in roots)


def compute_dtypes(
    module: nn.Module, policy: MixedPrecisionPolicy
) -> tuple[dict[int, torch.dtype], dict[str, torch.dtype]]:
    """Compute dtype of every parameter (by `id`) and every buffer (by name; floating only).

    Raises:
        MixedPrecisionError: a tied parameter is used both inside and outside `fp32_modules`.
    """
    roots = [name for name, _ in _fp32_roots(module, policy)]
    params: dict[int, torch.dtype] = {}
    first: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        dtype = torch.float32 if _in_fp32(name, roots) else policy.param_dtype
        key = id(param)
        if key in params and params[key] != dtype:
            raise MixedPrecisionError(
                f"parameter {name!r} is tied to {first[key]!r}, but one is inside an fp32 "
                f"module (MixedPrecisionPolicy.fp32_modules) and the other computes in "
                f"{policy.param_dtype}; untie them or keep both modules in fp32"
            )
        params.setdefault(key, dtype)
        first.setdefault(key, name)
    buffers = {
        name: torch.float32
        if _in_fp32(name, roots)
        else torch.promote_types(buf.dtype, torch.float32)
        if _non_persistent(module, name)
        else policy.param_dtype
        for name, buf in module.named_buffers(remove_duplicate=False)
        if buf.is_floating_point()
    }
    return params, buffers


def _non_persistent(module: nn.Module, name: str) -> bool:
    """Whether buffer `name` is left out of `state_dict()` (e.g. rotary `inv_freq`).

    Such buffers are derived constants the module rebuilds (frequencies, masks), not trained
    state: lowering them to `param_dtype` only loses precision (bf16 rotary frequencies
    triple the loss gap to fp32), so they stay in (at least) fp32.
    """
    owner, _, attr = name.rpartition(".")
    return attr in module.get_submodule(owner)._non_persistent_buffers_set


def _owner(name: str) -> str:
    owner = name.rpartition(".")[0]
    return repr(owner) if owner else "the root module"


def check_stored_dtypes(
    module: nn.Module, policy: MixedPrecisionPolicy, dtypes: dict[int, torch.dtype]
) -> None:
    """Refuse to silently recast a parameter away from a dtype the user chose (see the note).

    Raises:
        MixedPrecisionError: naming the module and how to fix it.
    """
    named = list(module.named_parameters())
    mixed = any(p.dtype in _LOW for _, p in named)
    for name, param in named:
        stored, compute = param.dtype, dtypes[id(param)]
        if stored == compute:
            continue
        if stored == torch.float32 and not mixed:
            continue  # the usual case: an fp32 model trained in param_dtype
        if compute == torch.float32 and stored in _LOW and policy.fp32_modules:
            # Upcast by an fp32 module of the policy (the user asked for it by class).
            roots = [n for n, _ in _fp32_roots(module, policy)]
            if _in_fp32(name, roots):
                continue
        if stored == torch.float32:
            hint = (
                f"add its class ({type(module.get_submodule(name.rpartition('.')[0])).__name__})"
                " to MixedPrecisionPolicy.fp32_modules to keep it in fp32, or convert it to "
                f"{compute} before wrapping"
            )
        elif stored in _DTYPES:
            hint = (
                f"set MixedPrecisionPolicy(param_dtype={stored}) or convert it with "
                f".to({compute}) before wrapping"
            )
        else:
            hint = (
                f"convert it with .to({compute}) before wrapping (the engine computes in "
                "torch.float32, torch.bfloat16 or torch.float16)"
            )
        raise MixedPrecisionError(
            f"parameter {name!r} of {_owner(name)} is stored in {stored} but would compute in "
            f"{compute} under the mixed-precision policy; the engine does not silently recast "
            f"a dtype you chose: {hint}"
        )


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with every floating-point tensor cast to `dtype` (others untouched)."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _first_floating_dtype(tree: Any) -> torch.dtype | None:
    found: list[torch.dtype] = []

    def visit(x: Any) -> Any:
        if not found and isinstance(x, torch.Tensor) and x.is_floating_point():
            found.append(x.dtype)
        return x

    tree_map(visit, tree)
    return found[0] if found else None


def keep_fp32(module: nn.Module, policy: MixedPrecisionPolicy) -> list[Any]:
    """Hook the outermost `fp32_modules` instances: inputs to fp32, outputs back.

    Returns:
        The hook handles (removable).
    """
    handles: list[Any] = []
    for _, sub in _fp32_roots(module, policy):
        # One entry per call in flight (a module may be re-entered by activation recompute).
        stack: list[torch.dtype | None] = []

        def pre(
            mod: nn.Module,
            args: Any,
            kwargs: Any,
            stack: list[torch.dtype | None] = stack,
        ) -> tuple[Any, Any]:
            stack.append(_first_floating_dtype((args, kwargs)))
            cast: tuple[Any, Any] = cast_floating((args, kwargs), torch.float32)
            return cast

        def post(
            mod: nn.Module,
            args: Any,
            output: Any,
            stack: list[torch.dtype | None] = stack,
        ) -> Any:
            dtype = stack.pop() if stack else None
            if dtype is None or dtype == torch.float32:
                return output
            return cast_floating(output, dtype)

        # First in, last out: the module's own hooks see its fp32 inputs and outputs.
        handles.append(sub.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(sub.register_forward_hook(post))
    return handles
