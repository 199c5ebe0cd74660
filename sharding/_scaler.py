"""`ShardedLossScaler`: dynamic loss scaling over sharded fp32 main gradients.

One scaler per `DistributedOptimizer` (its policy has `loss_scale`). A step goes:

```
scale_loss(loss) -> backward (gradients reduced, still scaled) -> unscale_() [clip] -> step
```
`unscale_()` runs once per step (from `clip_grad_norm_` or `step`): every rank looks for
inf/NaN in its own gradient shards, one all-reduce of a flag makes the verdict global (a
rank's clean shard must not step while another's overflowed: the model would split), and
clean gradients are divided by the scale in place. `update()` after the step backs off (and
counts a skipped step) or grows the scale. Every rank computes the same scale from the same
verdicts, so the scale never needs a broadcast; it is saved in the optimizer's state dict.
"""

from __future__ import annotations

from typing import Any

import torch

from sharding._comm import Communicator
from sharding._precision import DynamicLossScale
from sharding.errors import ShardingError

__all__ = ["ShardedLossScaler"]


class ShardedLossScaler:
    """The dynamic scale, its growth counter and the per-step overflow verdict."""

    def __init__(self, config: DynamicLossScale, comm: Communicator) -> None:
        """Start at `config.init_scale`.

        Args:
            config: the policy's scaling parameters.
            comm: the data-parallel communicator (overflow flags are all-reduced on it).
        """
        self.config = config
        self._comm = comm
        self.scale = float(config.init_scale)
        """Current loss scale."""
        self.growth_tracker = 0
        """Clean steps in a row since the scale last changed."""
        self.num_skipped_steps = 0
        """Steps skipped because some gradient overflowed (since the engine was built)."""
        self._scaled = False
        self._unscaled = False
        self._found_inf = False

    @property
    def found_inf(self) -> bool:
        """This step's verdict (valid between `unscale_` and `update`)."""
        return self._found_inf

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * scale` (call `.backward()` on the result)."""
        self._scaled = True
        return loss * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Check every rank's `grads` for inf/NaN and unscale them (once per step; collective).

        Returns:
            Whether some gradient on some rank overflowed (the step will be skipped).

        Raises:
            ShardingError: no `scale_loss` since the last step (gradients are not scaled).
        """
        if self._unscaled:
            return self._found_inf
        if not self._scaled:
            raise ShardingError(
                "the mixed-precision policy has loss_scale, but this step's loss was not "
                "scaled: call optimizer.scale_loss(loss).backward() instead of "
                "loss.backward() (fp16 gradients underflow otherwise)"
            )
        device = self._comm.device
        bad = [torch.logical_not(torch.isfinite(g)).any() for g in grads]
        flag = torch.stack(bad).any().float() if bad else torch.zeros((), device=device)
        # Every rank must take the same decision: one tiny all-reduce per step.
        found = bool(self._comm.sum_scalar(flag.reshape(1)).item() > 0)
        if not found and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        self._unscaled = True
        self._found_inf = found
        return found

    def update(self) -> None:
        """After the step (taken or skipped): back off or grow the scale, reset the verdict."""
        cfg = self.config
        if self._found_inf:
            self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
            self.growth_tracker = 0
            self.num_skipped_steps += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker >= cfg.growth_interval:
                self.scale *= cfg.growth_factor
                self.growth_tracker = 0
        self._scaled = self._unscaled = self._found_inf = False

    def state_dict(self) -> dict[str, Any]:
        """Plain values (every rank holds the same)."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "num_skipped_steps": self.num_skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.num_skipped_steps = int(state.get("num_skipped_steps", 0))
