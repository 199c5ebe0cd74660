"""`FullyShardedDataParallel`: the public wrapper that builds buffers, hooks and the engine."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sharding._buffer import FlatBucket
from sharding._comm import Communicator
from sharding._config import ShardingConfig
from sharding._engine import Engine
from sharding._hooks import TrainingState
from sharding._layout import build_layout, detect_unit_classes
from sharding._materialize import MetaMaterializer, is_meta_module
from sharding._mesh import HybridGroups, build_hybrid_groups
from sharding._module_buffers import ModuleBuffers
from sharding._optimizer import DistributedOptimizer
from sharding._param import engine_access
from sharding._precision import (
    cast_floating,
    check_stored_dtypes,
    compute_dtypes,
    fp32_module_ids,
    keep_fp32,
)
from sharding._state_dict import (
    StateDict,
    full_state_dict,
    load_model_sharded_state_dict,
    model_sharded_state_dict,
)
from sharding._stats import CollectiveObserver, ShardingStats
from sharding.errors import DeviceMismatchError, ShardingError

__all__ = ["FullyShardedDataParallel"]


def _resolve_device(
    module: nn.Module, device: torch.device | str | None, *, deferred: bool
) -> torch.device:
    if device is None:
        first = None if deferred else next(iter(module.parameters()), None)
        resolved = first.device if first is not None else torch.device("cpu")
    else:
        resolved = torch.device(device)
    index: int | None = getattr(resolved, "index", None)
    if resolved.type == "cuda" and index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


def _hybrid_groups(
    config: ShardingConfig, process_group: dist.ProcessGroup | None, device: torch.device
) -> HybridGroups | None:
    """The replicate x shard groups `config.shard_group_size` asks for (`None`: plain)."""
    size = config.shard_group_size
    if size is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if size != 1:
            raise ValueError(
                f"ShardingConfig.shard_group_size={size} does not divide the world size 1 "
                "(torch.distributed is not initialised); use None or 1"
            )
        return None
    world = dist.get_world_size()
    if process_group is not None and dist.get_world_size(process_group) != world:
        raise ValueError(
            "ShardingConfig.shard_group_size needs the default process group (hybrid groups "
            "are built from the whole world); pass process_group=None"
        )
    if size == world:
        return None
    # Raises ValueError when `size` does not divide the world.
    return build_hybrid_groups(size, gather_group=device.type == "cuda")


def _check_device(module: nn.Module, device: torch.device) -> None:
    for kind, named in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for name, tensor in named:
            if tensor.device != device:
                raise DeviceMismatchError(
                    f"{kind} {name!r} is on {tensor.device} but the engine runs on {device}; "
                    f"move the module first (module.to({str(device)!r})) or pass device="
                )


class FullyShardedDataParallel(nn.Module):
    """Shards a module's training state across data-parallel ranks (see `ShardingConfig`).

    The wrapped module's parameters are replaced by views of flat per-bucket buffers; build
    the optimizer with `make_optimizer`, never on `module.parameters()`. Every rank must run
    the same forward and backward calls in the same order (collectives are issued from them).

    Outside forward (see the note in `sharding/_param.py`): under `OPTIM_GRADS_PARAMS` a
    parameter keeps its shape but has no memory, and any torch call that reads or writes it
    raises `ParameterNotGatheredError` (use `summon_full_params()`, `sharded_state_dict()` or
    `full_state_dict()`); under the other strategies parameters hold the whole current
    weights. Under every strategy `.grad` of a parameter raises `GradientsInEngineError`, so
    `torch.nn.utils.clip_grad_norm_` and torch optimizers on `model.parameters()` fail loudly.

    Example:
        model = FullyShardedDataParallel(gpt, ShardingConfig(unit_modules=(Block,)))
        opt = model.make_optimizer(torch.optim.AdamW, lr=3e-4)
        lm_loss(model(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        config: ShardingConfig | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        observer: CollectiveObserver | None = None,
    ) -> None:
        """Wrap `module` (collective: every rank of the group calls it).

        Args:
            module: the model, already on `device`; rank 0's weights are broadcast. Or a
                model built on the `meta` device: then every rank materializes and
                initializes it one unit at a time, keeping only its shards
                (`ShardingConfig.deferred_init`, [Note: deferred init] in
                `sharding/_materialize.py`).
            config: sharding configuration (defaults to ZeRO-3 with detected units).
            process_group: data-parallel group (default group when None; world size 1 when
                `torch.distributed` is not initialised); hybrid sharding
                (`config.shard_group_size`) needs the default group.
            device: compute device; defaults to the device of the module's parameters (the
                CPU for a meta-device model).
            observer: receives one call per completed collective.

        Raises:
            ValueError: `config.shard_group_size` does not divide the world size, or comes
                with a `process_group` smaller than the world.
            DeviceMismatchError: a parameter or buffer is on another device.
            DeferredInitError: only part of the model is on `meta`, or its initialization
                leaves a parameter or buffer unwritten.
            MixedPrecisionError: the policy would recast a parameter the user kept in a dtype.
        """
        super().__init__()
        self.config = config or ShardingConfig()
        deferred = is_meta_module(module)
        self.device = _resolve_device(module, device, deferred=deferred)
        if not deferred:
            _check_device(module, self.device)
        self.module = module
        self.stats = ShardingStats()
        """Engine counters; `stats.snapshot()` returns a `ShardingStatsSnapshot`."""
        self._comm = Communicator(
            process_group,
            self.device,
            self.stats,
            observer,
            hybrid=_hybrid_groups(self.config, process_group, self.device),
        )
        self.precision = self.config.precision
        """The effective `MixedPrecisionPolicy`."""
        param_dtypes, buffer_dtypes = compute_dtypes(module, self.precision)
        check_stored_dtypes(module, self.precision, param_dtypes)
        unit_classes = self.config.unit_modules
        if unit_classes is None:
            unit_classes = detect_unit_classes(module)
        units, layouts, unit_modules = build_layout(
            module,
            unit_classes,
            world_size=self._comm.world_size,
            compute_dtype=self.precision.param_dtype,
            bucket_size_bytes=self.config.bucket_size_bytes,
            param_dtypes=param_dtypes,
        )
        current = dict(module.named_parameters(remove_duplicate=False))
        owned = [[s.names[0] for b in unit.buckets for s in layouts[b].slots] for unit in units]
        materializer = (
            MetaMaterializer(module, units, owned, self.device, self.config.deferred_init)
            if deferred
            else None
        )
        buckets: list[FlatBucket] = []
        # Unit by unit, so that a meta model exists in full for one unit at a time only.
        for unit in units:
            sources = current if materializer is None else materializer.unit_sources(unit.index)
            for layout in (layouts[b] for b in unit.buckets):
                bucket = FlatBucket(
                    layout,
                    self.config.strategy,
                    self._comm,
                    layout.compute_dtype,
                    [sources[slot.names[0]].detach() for slot in layout.slots],
                    unit_name=unit.name or "(root)",
                    reduce_dtype=self.precision.reduce_dtype,
                    broadcast=materializer is None,
                )
                assert bucket.layout.index == len(buckets)
                for slot, param in zip(layout.slots, bucket.params, strict=True):
                    for name in slot.names:
                        owner, _, attr = name.rpartition(".")
                        module.get_submodule(owner)._parameters[attr] = param
                buckets.append(bucket)
            if materializer is not None:
                del sources
                materializer.release(unit.index)
        if materializer is not None:
            materializer.finish()
        self._module_buffers = ModuleBuffers(
            module, buffer_dtypes, self._comm, self.config.buffer_sync
        )
        self._buffers_by_name = self._module_buffers.persistent
        self._param_names = [name for name in module.state_dict(keep_vars=True) if name in current]
        self._state_names = list(module.state_dict(keep_vars=True))
        self._engine = Engine(
            self.config,
            self._comm,
            self.stats,
            [[buckets[b] for b in unit.buckets] for unit in units],
        )
        self._summoned = False
        self.unit_names = [unit.name for unit in units[:-1]]
        """Qualified names of the FSDP units, in registration order."""
        self._register_hooks(unit_modules)
        # `module.state_dict()` reads compute weights: [Note: deferred weight gather].
        self.register_state_dict_pre_hook(self._wait_before_state_dict)  # type: ignore[no-untyped-call]
        if self.precision.param_dtype != torch.float32:
            keep_fp32(module, self.precision)

    def _register_hooks(self, unit_modules: list[nn.Module | None]) -> None:
        engine = self._engine
        cast_inputs = self.precision.cast_forward_inputs
        param_dtype = self.precision.param_dtype
        # Units inside fp32 modules get their inputs from those modules' fp32 casts.
        in_fp32 = fp32_module_ids(self.module, self.precision)

        def check_wrapped(module: nn.Module, args: Any) -> None:
            engine.check_wrapped()

        self.module.register_forward_pre_hook(check_wrapped, prepend=True)
        for index, unit in enumerate(unit_modules):
            if unit is None:
                continue

            def pre_forward(module: nn.Module, args: Any, kwargs: Any, index: int = index) -> Any:
                return engine.unit_pre_forward(index, args, kwargs)

            def post_forward(module: nn.Module, args: Any, output: Any, index: int = index) -> None:
                engine.unit_post_forward(index, output)

            unit.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
            unit.register_forward_hook(post_forward)
            if cast_inputs and id(unit) not in in_fp32:
                # Runs first, so the engine sees (and routes backward through) the cast inputs.

                def cast(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
                    cast_args: tuple[Any, Any] = cast_floating((args, kwargs), param_dtype)
                    return cast_args

                unit.register_forward_pre_hook(cast, prepend=True, with_kwargs=True)

    def _wait_before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._engine.wait_pending_weights()

    def wait_pending_weights(self) -> None:
        """Wait until the weights of the last optimizer step are in every parameter.

        `DistributedOptimizer.step()` leaves the weight all-gathers of `OPTIM` /
        `OPTIM_GRADS` running ([Note: deferred weight gather] in `sharding/_optimizer.py`);
        the engine waits on its own before anything reads the weights, so this is only
        needed to time or synchronise explicitly. Idempotent; a no-op under the other
        strategies.
        """
        self._engine.wait_pending_weights()

    @property
    def world_size(self) -> int:
        """Number of data-parallel ranks (every shard group's together under hybrid sharding)."""
        return self._comm.dp_world_size

    @property
    def rank(self) -> int:
        """This process's data-parallel rank."""
        return self._comm.dp_rank

    @property
    def shard_group_size(self) -> int:
        """Ranks the training state is sharded across (`world_size` unless hybrid)."""
        return self._comm.world_size

    @property
    def num_replicas(self) -> int:
        """Copies of the sharded training state, one per shard group (1 unless hybrid)."""
        return self._comm.num_replicas

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (gathering weights as the strategy requires)."""
        if self._summoned:
            raise ShardingError("forward inside summon_full_params(); leave the context first")
        policy = self.precision
        if policy.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
        self._module_buffers.pre_forward()
        self._engine.root_pre_forward()
        # [Note: parameters inside forward] in `_param.py`: ZeRO-3 keeps the checks on (a
        # unit's weights exist only while it runs); elsewhere every weight is whole, except
        # while a step's weight gathers are pending: then the checks stay on so that code
        # reading a unit's weight before that unit runs waits (`Gate.try_open`).
        checked = self.config.strategy.shards_params or self._engine.has_pending_weights()
        checks = contextlib.nullcontext() if checked else engine_access()
        with checks:
            output = self.module(*args, **kwargs)
        if policy.output_dtype is not None:
            output = cast_floating(output, policy.output_dtype)
        self._module_buffers.post_forward(
            trained=torch.is_grad_enabled() and self._engine.is_last_microbatch
        )
        self._engine.root_post_forward(output)
        return output

    @contextlib.contextmanager
    def summon_full_params(self, *, writeback: bool = False) -> Iterator[None]:
        """Make every parameter hold its whole weight inside the context (collective).

        Every rank must enter and leave it together. Under `OPTIM_GRADS_PARAMS` each unit is
        gathered on entry and released on exit (peak memory: the whole model in the compute
        dtype); under the other strategies parameters are whole anyway. Parameters inside
        hold the compute weights (`param_dtype`), e.g. for `model.state_dict()`, norms or
        evaluation code that reads weights. Do not run the wrapper's forward inside; the
        inner module may be called inside without grad (`model.module(...)`,
        `model.module.generate(...)`: [Note: generation] at `generate`).

        Args:
            writeback: copy edits made inside back into the engine's weights on exit (every
                rank must make the same edits; with a `param_dtype` below fp32 this rounds
                the fp32 main weights to it). Without it, edits are undefined: discarded
                under `OPTIM_GRADS_PARAMS`, possibly kept under the other strategies.

        Raises:
            ShardingError: called inside forward/backward or inside another
                `summon_full_params`.
        """
        if self._summoned or self._engine.state is not TrainingState.IDLE:
            raise ShardingError(
                "summon_full_params() must be entered outside forward/backward and not nested"
            )
        self._engine.wait_pending_weights()
        self._summoned = True
        try:
            self._engine.gather_all()
            self._engine.summoned = True
            yield
            if writeback:
                for bucket in self._engine.buckets:
                    bucket.write_back_full()
                pending = [
                    p for b in self._engine.buckets if (p := b.push_main_weights()) is not None
                ]
                for p in pending:
                    p.wait()
        finally:
            self._engine.summoned = False
            self._engine.reshard_all()
            self._summoned = False

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The inner module's `generate(*args, **kwargs)` (e.g. a Hugging Face model's).

        [Note: generation] Generation calls the inner module many times, with inputs (and a
        cache) the wrapper's forward does not see. It runs inside `summon_full_params()` and
        `torch.no_grad()`: every unit is gathered once on entry (collective: every rank calls
        `generate` together; peak memory is the whole model in the compute dtype under
        `OPTIM_GRADS_PARAMS`) and released on exit, and the unit hooks stand aside meanwhile.
        The same holds for any inference code: inside `with model.summon_full_params():` the
        inner module (`model.module(...)`, `model.module.generate(...)`) may be called
        without grad.

        Raises:
            AttributeError: the inner module has no `generate`.
            ShardingError: called inside forward/backward or inside `summon_full_params()`.
        """
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise AttributeError(
                f"the wrapped {type(self.module).__name__} has no generate(); run your own "
                "decoding loop on model.module inside `with model.summon_full_params():`"
            )
        with torch.no_grad(), self.summon_full_params():
            return generate(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the engine's accumulated gradients (as `DistributedOptimizer.zero_grad`).

        Args:
            set_to_none: ignored; the engine always drops gradients.
        """
        del set_to_none
        for bucket in self._engine.buckets:
            bucket.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches inside accumulate gradients; the next one outside reduces.

        `NO_SHARD` and `OPTIM` add into their whole local fp32 gradient and reduce once, on
        the first micro-batch outside the context (as DDP). `OPTIM_GRADS` and
        `OPTIM_GRADS_PARAMS` follow `ShardingConfig.no_sync_mode`: by default
        (`REDUCE_SCATTER`) they still reduce-scatter every micro-batch, since they keep no
        whole gradient (n reduce-scatters per window of n micro-batches, no extra memory);
        `ACCUMULATE_UNSHARDED` holds whole fp32 gradients on each rank instead and reduces
        once (1 reduce-scatter per window, 4 bytes per trained parameter held meanwhile).
        Gradients are correct either way. Held gradients reach the optimizer only through
        a micro-batch outside the context.
        """
        previous = self._engine.is_last_microbatch
        self._engine.is_last_microbatch = False
        try:
            yield
        finally:
            self._engine.is_last_microbatch = previous

    def make_optimizer(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        param_groups: Iterable[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> DistributedOptimizer:
        """Build a distributed optimizer over this rank's fp32 main-weight shards.

        Groups work as torch's: `param_groups` is what `optimizer_class(param_groups,
        **kwargs)` would take, each group a dict with `"params"` and its own
        hyperparameters, `kwargs` the defaults. `"params"` holds this wrapper's parameters
        (`model.parameters()` after wrapping, e.g. from `sharding.no_decay_groups(model,
        0.1)`) or their names in the wrapped module (`model.module.named_parameters()`,
        as in state dicts). Every trained parameter must be in exactly one group. Each
        group becomes one group of the torch optimizer (`.optimizer.param_groups[i]`), so LR
        schedulers scale each group's `lr` as usual.

        Args:
            optimizer_class: e.g. `torch.optim.AdamW` (elementwise optimizers).
            param_groups: torch-style groups; `None` for one group of every parameter.
            **kwargs: default hyperparameters.

        Returns:
            The optimizer; `.optimizer` is the torch optimizer (for LR schedulers).

        Raises:
            ValueError: a group lists an unknown parameter or one twice, or one is missing.
        """
        return DistributedOptimizer(self._engine, optimizer_class, param_groups, **kwargs)

    def sharded_state_dict(self) -> StateDict:
        """This rank's pieces of every parameter (`ShardedTensor`, flat form) and buffers.

        Its keys are exactly `module.state_dict()`'s (non-persistent buffers left out), tied
        names folded into the first one and listed under `ALIASES_KEY`.
        """
        self._engine.wait_pending_weights()
        return model_sharded_state_dict(self._engine.buckets, self._buffers_by_name)

    def load_sharded_state_dict(self, state_dict: StateDict) -> None:
        """Load weights saved by `sharded_state_dict` (collective under sharded strategies).

        Each value may be a piece with exactly this rank's range, the whole tensor, or a list
        of pieces from any world size or strategy that covers this rank's range. Keys of the
        module's non-persistent buffers (held by checkpoints written before they were left
        out) are ignored.

        Raises:
            StateDictLayoutError: keys, shapes or coverage do not match.
        """
        self._engine.wait_pending_weights()
        self._engine.reshard_all()
        load_model_sharded_state_dict(
            self._engine.buckets,
            self._buffers_by_name,
            state_dict,
            self._module_buffers.non_persistent,
        )
        pending = [p for b in self._engine.buckets if (p := b.push_main_weights()) is not None]
        for p in pending:
            p.wait()

    def full_state_dict(self) -> StateDict:
        """Every weight gathered (fp32 main weights in the original dtypes), on rank 0.

        Collective under sharded strategies: every rank must call it.

        Returns:
            On rank 0 a dict loadable by the unwrapped module's `load_state_dict`; `{}` elsewhere.
        """
        self._engine.wait_pending_weights()
        return full_state_dict(
            self._engine.buckets,
            self._state_names,
            self._module_buffers.exported(),
            self._comm.dp_rank,
        )

    @functools.cached_property
    def num_units(self) -> int:
        """Number of FSDP units (the root unit not counted)."""
        return len(self.unit_names)
