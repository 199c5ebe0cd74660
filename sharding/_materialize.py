"""Deferred init: a model built on the `meta` device is materialized one FSDP unit at a time.

[Note: deferred init] A model built under `with torch.device("meta"):` has shapes and dtypes
but no memory. The wrapper walks the units in order (the root unit last, see `_layout.py`);
for each unit it gives every parameter the unit owns, and every buffer of the unit's
modules, fresh storage on the engine's device, initializes the unit's modules, copies the
values into the unit's flat buckets (under ZeRO-3 only this rank's shard is copied) and drops
the materialized tensors before the next unit. So no rank ever holds more than its sharded
state plus one unit in full. Every rank initializes every unit itself: nothing is broadcast.

Initialization is deterministic and independent of the world size and the strategy: each
module that directly holds parameters or buffers is initialized under torch's default
generator (and, on CUDA, the device's) seeded from `(DeferredInit.seed, the module's
qualified name)`, by `DeferredInit.init_fn(module)` or else by the module's own
`reset_parameters()`. The global RNG state is restored afterwards. The same seed on the same
device type gives bitwise the same full weights at any world size.

Materialized floating tensors start as NaN, so a parameter or buffer that no init writes is
caught (`DeferredInitError` names it and its module) instead of training on garbage;
integer ones must be written in place (their version counter must move). A buffer may be
replaced by a new tensor (e.g. `self.register_buffer("cos", ..., persistent=False)` in
`reset_parameters()`); a parameter must be written in place, so ties stay ties.

Tied parameters: a parameter lives in one unit (the root unit when modules of several units
use it, `_layout.py`); a module of another unit that holds it writes it too, so it is
materialized with the first unit that needs it and kept until its own unit is copied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from sharding._layout import UnitLayout
from sharding.errors import DeferredInitError

__all__ = ["DeferredInit", "MetaMaterializer", "is_meta_module"]

_SEED_BITS = 63


@dataclasses.dataclass(kw_only=True, frozen=True)
class DeferredInit:
    """How `FullyShardedDataParallel` initializes a model built on the `meta` device.

    Used only when every parameter and buffer of the wrapped module is on `meta` (see
    [Note: deferred init] in `sharding/_materialize.py`); ignored for a materialized model.
    """

    seed: int = 0
    """Base seed: each module is initialized under generators seeded from this seed and the
    module's qualified name, so the weights do not depend on the world size or strategy."""
    init_fn: Callable[[nn.Module], None] | None = None
    """Called once per module that directly holds parameters or buffers, under that module's
    seeded generator, to write them in place (`module.parameters(recurse=False)`,
    `module.buffers(recurse=False)`); `None` calls the module's own `reset_parameters()`."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(
                f"DeferredInit.seed must be a non-negative int, got {self.seed!r}; "
                "pass e.g. DeferredInit(seed=0)"
            )
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(
                f"DeferredInit.init_fn must be None or callable init_fn(module), got "
                f"{self.init_fn!r}"
            )

    def module_seed(self, name: str) -> int:
        """The seed of the module named `name` (qualified; `""` for the root module)."""
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> (64 - _SEED_BITS)


def is_meta_module(module: nn.Module) -> bool:
    """Whether every parameter and buffer of `module` is on the meta device.

    Returns:
        True for a model built on `meta`, False for one without any meta tensor.

    Raises:
        DeferredInitError: some tensors are on `meta` and others are not.
    """
    meta: list[str] = []
    real: list[tuple[str, torch.device]] = []
    for named in (module.named_parameters(), module.named_buffers()):
        for name, tensor in named:
            if tensor.is_meta:
                meta.append(name)
            else:
                real.append((name, tensor.device))
    if meta and real:
        raise DeferredInitError(
            f"{len(meta)} parameters/buffers of the module are on the meta device (e.g. "
            f"{meta[0]!r}) and {len(real)} are not (e.g. {real[0][0]!r} on {real[0][1]}); "
            "build the whole model under `with torch.device('meta'):` (the engine "
            "materializes and initializes it) or none of it"
        )
    return bool(meta)


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Seed torch's default generators of `device` (and the CPU's), restoring them after."""
    cuda = device.type == "cuda"
    index = device.index if device.index is not None else torch.cuda.current_device() if cuda else 0
    # Not `torch.manual_seed`: it would also queue a lazy seed for CUDA devices that are not
    # initialised yet, overriding the user's seed when they are.
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def _unit_modules(module: nn.Module, units: list[UnitLayout]) -> list[list[tuple[str, nn.Module]]]:
    """The modules of each unit, named; a module belongs to the innermost unit containing it
    (units are outermost instances, so: the unit whose name prefixes it, else the root)."""
    roots = [u.name for u in units[:-1]]
    out: list[list[tuple[str, nn.Module]]] = [[] for _ in units]
    for name, sub in module.named_modules():
        index = next(
            (i for i, r in enumerate(roots) if name == r or name.startswith(r + ".")),
            len(roots),
        )
        out[index].append((name, sub))
    return out


class MetaMaterializer:
    """Materializes and initializes a meta-device module one unit at a time (see the note).

    Args:
        module: the model, every parameter and buffer on `meta`.
        units: the layout's units (root unit last).
        owned: qualified names of the parameters each unit owns (first name of each).
        device: where tensors are materialized (the engine's device).
        init: seed and init function.
    """

    def __init__(
        self,
        module: nn.Module,
        units: list[UnitLayout],
        owned: list[list[str]],
        device: torch.device,
        init: DeferredInit,
    ) -> None:
        if device.type == "meta":
            raise DeferredInitError(
                "a meta-device model needs a real device to be materialized on; pass "
                "device='cpu' or device='cuda' to FullyShardedDataParallel"
            )
        self._device = device
        self._init = init
        self._owned = owned
        self._modules = _unit_modules(module, units)
        # Every (module, attribute) holding each parameter / buffer, by the meta tensor's id
        # (`_metas` keeps those tensors alive, so no id is reused while this object lives).
        self._metas = [*module.parameters(), *module.buffers()]
        self._param_sites: dict[int, list[tuple[nn.Module, str]]] = {}
        self._param_first: dict[str, int] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            self._param_sites.setdefault(id(p), []).append((module.get_submodule(owner), attr))
            self._param_first.setdefault(name, id(p))
        self._buffer_sites: dict[int, list[tuple[nn.Module, str]]] = {}
        for name, b in module.named_buffers(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            self._buffer_sites.setdefault(id(b), []).append((module.get_submodule(owner), attr))
        self._live: dict[int, nn.Parameter] = {}
        """Materialized parameters by their meta tensor's id, until their unit is copied."""
        self._versions: dict[int, int] = {}
        self._buffers: list[tuple[str, nn.Module, str, torch.Tensor, int]] = []
        """Materialized buffers: (qualified name, module, attribute, tensor, version)."""

    def _empty(self, like: torch.Tensor) -> torch.Tensor:
        out = torch.empty(like.shape, dtype=like.dtype, device=self._device)
        if out.is_floating_point() or out.is_complex():
            out.fill_(float("nan"))
        return out

    def _materialize_params_of(self, sub: nn.Module) -> None:
        for p in list(sub._parameters.values()):
            if p is None or not p.is_meta:
                continue
            key = id(p)
            with torch.no_grad():
                new = nn.Parameter(self._empty(p), requires_grad=p.requires_grad)
            self._versions[id(new)] = new._version
            self._live[key] = new
            for owner, site in self._param_sites[key]:
                owner._parameters[site] = new

    def _materialize_buffers_of(self, name: str, sub: nn.Module) -> None:
        for attr, b in list(sub._buffers.items()):
            if b is None or not b.is_meta:
                continue
            new = self._empty(b)
            for owner, site in self._buffer_sites[id(b)]:
                owner._buffers[site] = new
            self._buffers.append((f"{name}.{attr}" if name else attr, sub, attr, new, new._version))

    def _initialize(self, name: str, sub: nn.Module) -> None:
        init_fn = self._init.init_fn
        if init_fn is None:
            reset = getattr(sub, "reset_parameters", None)
            if not callable(reset):
                return  # reported by the checks, with the tensors it leaves unwritten
            init_fn = _call_reset
        with _seeded(self._device, self._init.module_seed(name)), torch.no_grad():
            init_fn(sub)

    def unit_sources(self, unit: int) -> dict[str, torch.Tensor]:
        """Materialize and initialize unit `unit`; its parameters' values by first name.

        Call `release(unit)` once they are copied. Units must come in order, root last.
        """
        mods = self._modules[unit]
        for _, sub in mods:
            self._materialize_params_of(sub)
        for name, sub in mods:
            self._materialize_buffers_of(name, sub)
        for name, sub in mods:
            if any(True for _ in sub.parameters(recurse=False)) or any(
                True for _ in sub.buffers(recurse=False)
            ):
                self._initialize(name, sub)
        out: dict[str, torch.Tensor] = {}
        for pname in self._owned[unit]:
            key = self._param_first[pname]
            new = self._live.get(key)
            if new is None:
                raise DeferredInitError(
                    f"parameter {pname!r} belongs to no module of its FSDP unit; this "
                    "module layout is not supported by deferred init"
                )
            self._check_param(pname, key, new)
            out[pname] = new.detach()
        return out

    def release(self, unit: int) -> None:
        """Forget unit `unit`'s materialized parameters (the engine holds copies now)."""
        for pname in self._owned[unit]:
            self._live.pop(self._param_first[pname], None)

    def _check_param(self, name: str, key: int, new: nn.Parameter) -> None:
        for owner, site in self._param_sites[key]:
            if owner._parameters[site] is not new:
                raise DeferredInitError(
                    f"initializing {type(owner).__name__} replaced parameter {name!r} with "
                    "a new tensor; write parameters in place (torch.nn.init.*_, "
                    "param.copy_(...)) so that tied parameters stay tied"
                )
        self._check_written(name, new, self._versions[id(new)], self._param_sites[key][0][0])

    def finish(self) -> None:
        """Check every materialized buffer was initialized; move replaced ones to the device.

        Raises:
            DeferredInitError: a buffer was left unwritten.
        """
        for name, sub, attr, tensor, version in self._buffers:
            current = sub._buffers.get(attr)
            if current is None:
                continue
            if current is not tensor:
                if current.is_meta:
                    raise DeferredInitError(
                        f"buffer {name!r} was replaced by a meta tensor while initializing "
                        f"{type(sub).__name__}; create it on the materialized parameters' "
                        "device (e.g. device=self.weight.device)"
                    )
                if current.device != self._device:
                    sub._buffers[attr] = current.to(self._device)
                continue
            self._check_written(name, tensor, version, sub)
        self._buffers.clear()

    def _check_written(
        self, name: str, tensor: torch.Tensor, version: int, owner: nn.Module
    ) -> None:
        floating = tensor.is_floating_point() or tensor.is_complex()
        with torch.no_grad():
            written = not bool(tensor.isnan().any()) if floating else tensor._version != version
        if written:
            return
        how = (
            "DeferredInit.init_fn"
            if self._init.init_fn is not None
            else f"{type(owner).__name__}.reset_parameters()"
            if callable(getattr(owner, "reset_parameters", None))
            else f"nothing ({type(owner).__name__} has no reset_parameters())"
        )
        raise DeferredInitError(
            f"{name!r} of a meta-device model was not initialized by {how}"
            + (" (some elements are still NaN)" if floating else "")
            + "; give the module a reset_parameters() that writes all its parameters and "
            "buffers in place, or pass ShardingConfig(deferred_init=DeferredInit(init_fn=...))"
        )


def _call_reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]
