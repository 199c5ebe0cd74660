"""A structlog logger that imports structlog at its first message.

[Note: the writer starts without structlog] (`_save/writer.py`): the writer process imports
the backends, which log almost never, and importing structlog (with `rich`) at every writer
start was a quarter of its start-up.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LazyLogger"]


class LazyLogger:
    """`structlog.get_logger(name)`, made (and structlog imported) when first used."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger: Any = None

    def __getattr__(self, method: str) -> Any:
        if self._logger is None:
            import structlog

            self._logger = structlog.get_logger(self._name)
        return getattr(self._logger, method)
