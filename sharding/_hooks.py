"""Autograd plumbing: the post-backward identity function and pre-backward output hooks.

[Note: post-backward timing] A unit's inputs are wrapped in `_PostBackward`, an identity
autograd function. Its backward runs once the gradient of every input is complete, i.e.
after all of the unit's operations ran backward; the engine runs `AccumulateGrad` nodes at
the highest priority, so the unit's parameter gradients are final by then. Units whose inputs
need no gradient (token ids) and parameters used outside their unit's call are handled by the
root post-backward callback queued on the autograd engine, which runs after the whole graph.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["TrainingState", "queue_end_of_backward", "register_pre_backward", "wrap_inputs"]


class TrainingState(enum.Enum):
    """What the engine is doing (checked by every hook)."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.callback()
        return (None, *grads)


def wrap_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], callback: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """Route the tensors among `args`/`kwargs` that need gradients through `_PostBackward`.

    Returns:
        `(args, kwargs, wrapped)`; `wrapped` is False when no input needs a gradient.
    """
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs, False
    outputs = _PostBackward.apply(callback, *(leaves[i] for i in positions))  # type: ignore[no-untyped-call]
    for i, out in zip(positions, outputs, strict=True):
        leaves[i] = out
    new_args, new_kwargs = tree_unflatten(leaves, spec)
    return new_args, new_kwargs, True


def register_pre_backward(output: Any, callback: Callable[[], None]) -> bool:
    """Call `callback` when the first gradient reaches any tensor of `output`.

    Returns:
        Whether some output tensor needs a gradient (so the hook can fire).
    """
    tensors = [
        x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.requires_grad
    ]
    if not tensors:
        return False
    if len(tensors) == 1:

        def hook(grad: torch.Tensor) -> None:
            callback()

        tensors[0].register_hook(hook)  # type: ignore[no-untyped-call]
    else:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: callback(), mode="any")
    return True


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` when the current backward pass has finished the whole graph."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
