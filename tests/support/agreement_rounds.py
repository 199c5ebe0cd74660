"""Counting the checkpoint finalizer's agreement rounds in this process (tests and benches)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class RoundCount:
    """How many agreement rounds (`Coordinator.max_async` calls) were issued; `reset()` zeroes."""

    def __init__(self) -> None:
        self.rounds = 0

    def reset(self) -> None:
        """Start counting from zero (e.g. after warm-up saves)."""
        self.rounds = 0


@contextlib.contextmanager
def counting_agreement_rounds() -> Iterator[RoundCount]:
    """Count every MAX poll round the finalizer issues while inside (every rank issues the
    same rounds, so each rank's count is the run's)."""
    from ckpt_manager._coord import Coordinator

    count = RoundCount()
    real_max_async = Coordinator.max_async

    def counting(self: Coordinator, values: Any) -> Any:
        count.rounds += 1
        return real_max_async(self, values)

    Coordinator.max_async = counting  # type: ignore[method-assign]
    try:
        yield count
    finally:
        Coordinator.max_async = real_max_async  # type: ignore[method-assign]
