"""Errors raised by the daemon.

DaemonError
├── ConfigError (ValueError)          a key or value is wrong: exit code 2, nothing started
│   └── StartupCheckError             the environment fails a start-up check (storage
│       │                             unreachable or not writable, port taken, job missing)
│       └── MemoryTierBusyError       this run and node's memory-tier directory belongs to a
│                                     daemon that may be alive (the same run started twice)
├── JobError (ValueError)             `--job` cannot be imported or returned a bad `JobSpec`
├── WorkersFailedError (RuntimeError) the worker group failed after `max_restarts` restarts
├── ForkServerError (RuntimeError)    the fork server cannot start ranks safely (the daemon
│                                     falls back to spawning them)
└── CheckpointFailuresError (RuntimeError)  `max_consecutive_save_failures` saves failed in a row
"""

from __future__ import annotations

__all__ = [
    "CheckpointFailuresError",
    "ConfigError",
    "DaemonError",
    "ForkServerError",
    "JobError",
    "MemoryTierBusyError",
    "StartupCheckError",
    "WorkersFailedError",
]


class DaemonError(Exception):
    """Base of every error the daemon raises on purpose."""


class ConfigError(DaemonError, ValueError):
    """A configuration key or value is invalid; the message names the key and what is allowed."""


class StartupCheckError(ConfigError):
    """A start-up check of the environment failed (before any rank started)."""


class MemoryTierBusyError(StartupCheckError):
    """This run and node's memory-tier directory is held by a daemon that may be alive."""


class JobError(DaemonError, ValueError):
    """The `--job` callable cannot be loaded or returned something that is not a `JobSpec`."""


class WorkersFailedError(DaemonError, RuntimeError):
    """The elastic agent gave up: workers failed more often than `max_restarts` allows."""


class ForkServerError(DaemonError, RuntimeError):
    """The rank fork server died, did not answer in time, or is not safe to fork (CUDA
    initialized or threads running after its imports); the message says which."""


class CheckpointFailuresError(DaemonError, RuntimeError):
    """Too many checkpoint saves failed in a row (`max_consecutive_save_failures`): the run
    stops rather than train on with nothing being saved."""
