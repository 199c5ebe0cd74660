"""One structlog configuration for every trainingd process.

JSON lines when stderr is not a TTY (journald, kubelet) or when asked; a coloured console renderer
otherwise. Process identity (`rank`, `local_rank`, `node`) is bound through contextvars so every
event carries it without threading loggers through call sites. stdlib loggers (torch, botocore,
fsspec) are routed through the same processor chain so one run produces one log format.
"""

from __future__ import annotations

import enum
import logging
import sys
from typing import Any, TextIO

import structlog

__all__ = ["LogFormat", "bind_process_context", "configure_logging"]


class LogFormat(enum.StrEnum):
    """How log events are rendered."""

    AUTO = "auto"
    """JSON when the stream is not a TTY, console otherwise."""
    JSON = "json"
    """One JSON object per line."""
    CONSOLE = "console"
    """Human-readable, coloured when the stream is a TTY."""


_PROCESS_CONTEXT: dict[str, Any] = {}
"""Fields `bind_process_context` bound: added to every event of every thread of the process."""


def _merge_process_context(
    logger: Any, method_name: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    # contextvars are per thread (a new thread starts with an empty context), so identity
    # bound there would be missing from the supervisor's, the checkpoint threads' and torch's
    # agent threads' events; this dict is process-wide. An event's own keys win.
    for key, value in _PROCESS_CONTEXT.items():
        event_dict.setdefault(key, value)
    return event_dict


def _shared_processors() -> list[structlog.typing.Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        _merge_process_context,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def _resolve(fmt: LogFormat, stream: TextIO) -> LogFormat:
    if fmt is not LogFormat.AUTO:
        return fmt
    isatty = getattr(stream, "isatty", None)
    return LogFormat.CONSOLE if isatty is not None and isatty() else LogFormat.JSON


def configure_logging(
    fmt: LogFormat | str = LogFormat.AUTO,
    *,
    level: int | str = logging.INFO,
    stream: TextIO | None = None,
    colors: bool | None = None,
) -> LogFormat:
    """Configure structlog and the stdlib root logger once per process.

    Args:
        fmt: `auto`, `json` or `console`.
        level: minimum level, as a `logging` constant or name (`"DEBUG"`).
        stream: where events go; default `sys.stderr`.
        colors: colour console output; None colours it when `stream` is a TTY. A rank whose
            output the daemon relays to its terminal writes to a file and passes True.

    Returns:
        The format actually chosen (`auto` resolved).

    Raises:
        ValueError: unknown format or level name.
    """
    try:
        chosen = LogFormat(fmt)
    except ValueError:
        allowed = ", ".join(f.value for f in LogFormat)
        raise ValueError(f"unknown log format {fmt!r}; use one of: {allowed}") from None
    if isinstance(level, str):
        numeric = logging.getLevelName(level.upper())
        if not isinstance(numeric, int):
            raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
        level = numeric
    out = stream if stream is not None else sys.stderr
    chosen = _resolve(chosen, out)

    renderer: structlog.typing.Processor
    if chosen is LogFormat.JSON:
        renderer = structlog.processors.JSONRenderer()
        final: list[structlog.typing.Processor] = [structlog.processors.dict_tracebacks, renderer]
    else:
        if colors is None:
            isatty = getattr(out, "isatty", None)
            colors = bool(isatty and isatty())
        renderer = structlog.dev.ConsoleRenderer(colors=colors)
        final = [renderer]

    shared = _shared_processors()
    structlog.configure(
        processors=[
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=False,
    )
    # stdlib records (torch, botocore, fsspec) and structlog events share one formatter and so
    # one output format; the formatter runs the shared chain on foreign records.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Third-party libraries are chatty at INFO; their warnings still come through.
    for noisy in ("botocore", "s3fs", "fsspec", "aiobotocore", "urllib3"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    _adopt_library_handlers()
    return chosen


def _adopt_library_handlers() -> None:
    # torch installs its own stderr handlers on `torch` and `torch.distributed` (propagate off),
    # which would print glog-style lines next to our JSON; route them through the root handler.
    # Their levels stay as torch set them (WARNING unless TORCH_LOGS says otherwise).
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.split(".")[0] in ("torch", "botocore"):
            for old in list(logger.handlers):
                logger.removeHandler(old)
            logger.propagate = True


def bind_process_context(**values: Any) -> None:
    """Bind identity fields (`rank`, `local_rank`, `node`, `run_id`, ...) to every later event.

    The binding is process-wide: events logged from any thread carry it. `None` values are
    skipped so callers can pass optional fields unconditionally.
    """
    _PROCESS_CONTEXT.update({k: v for k, v in values.items() if v is not None})
