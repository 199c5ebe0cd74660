"""Errors of the `ckptctl` command line (the engine's errors are in `ckpt_manager.errors`).

    UsageError (ValueError)    the command line is wrong (exit 2); the message says how to fix it

`UsageError` stands apart from `CheckpointError` on purpose: code that tolerates a failing
storage call (`except CheckpointError`) must never swallow an operator's mistake.
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """The `ckptctl` command line is wrong (exit code 2); the message says how to fix it."""
