"""The structlog foundation: formats and bound process context."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest
import structlog

from daemon import LogFormat, bind_process_context, configure_logging
from daemon import _logging as daemon_logging


@pytest.fixture(autouse=True)
def _reset_structlog() -> None:
    yield
    daemon_logging._PROCESS_CONTEXT.clear()
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()
    logging.getLogger().handlers.clear()


def test_json_lines_when_not_a_tty_with_context() -> None:
    out = io.StringIO()
    assert configure_logging(LogFormat.AUTO, stream=out) is LogFormat.JSON
    bind_process_context(rank=1, local_rank=1, node="n0", missing=None)
    structlog.get_logger("t").info("step_done", step=3)
    logging.getLogger("botocore.x").warning("from stdlib")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["event"] == "step_done"
    assert lines[0]["rank"] == 1
    assert lines[0]["node"] == "n0"
    assert lines[0]["step"] == 3
    assert "missing" not in lines[0]
    assert lines[0]["level"] == "info"
    # stdlib records go through the same pipeline, with the same bound context.
    assert lines[1]["event"] == "from stdlib"
    assert lines[1]["rank"] == 1


def test_bound_context_reaches_events_of_other_threads() -> None:
    # The supervisor, checkpoint and torch agent threads log too: the run_id an alert names
    # must be on their events as well (a contextvar binding is per thread and would not be).
    out = io.StringIO()
    configure_logging("json", stream=out)
    bind_process_context(run_id="run-a", role="daemon")
    worker = threading.Thread(target=lambda: structlog.get_logger("t").info("from_thread"))
    worker.start()
    worker.join()
    structlog.get_logger("t").info("own_keys_win", role="other")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert (first["event"], first["run_id"], first["role"]) == ("from_thread", "run-a", "daemon")
    assert (second["run_id"], second["role"]) == ("run-a", "other")


def test_console_when_asked() -> None:
    out = io.StringIO()
    assert configure_logging("console", stream=out) is LogFormat.CONSOLE
    structlog.get_logger().info("hello", x=1)
    text = out.getvalue()
    assert "hello" in text
    assert "x=1" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_console_colours_follow_the_stream_unless_forced() -> None:
    plain = io.StringIO()
    configure_logging("console", stream=plain)
    structlog.get_logger().info("hello")
    assert "\x1b[" not in plain.getvalue()  # a file: no colour codes
    # A rank whose output the daemon relays to its terminal writes to a file, in colour.
    relayed = io.StringIO()
    configure_logging("console", stream=relayed, colors=True)
    structlog.get_logger().info("hello")
    assert "\x1b[" in relayed.getvalue()


def test_level_filters_and_bad_values_are_rejected() -> None:
    out = io.StringIO()
    configure_logging("json", level="WARNING", stream=out)
    structlog.get_logger().info("hidden")
    structlog.get_logger().warning("shown")
    assert [json.loads(x)["event"] for x in out.getvalue().splitlines()] == ["shown"]
    with pytest.raises(ValueError, match="unknown log format"):
        configure_logging("xml")
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("json", level="LOUD")


def test_torch_loggers_are_routed_through_the_same_pipeline() -> None:
    # What torch does at import: its own stderr handler, propagation off.
    torch_logger = logging.getLogger("torch.distributed")
    torch_logger.addHandler(logging.StreamHandler(io.StringIO()))
    torch_logger.propagate = False
    out = io.StringIO()
    configure_logging("json", stream=out)
    bind_process_context(rank=3)
    logging.getLogger("torch.distributed.elastic.agent").warning("agent says %s", "hi")
    line = json.loads(out.getvalue().splitlines()[-1])
    assert line["event"] == "agent says hi"
    assert line["rank"] == 3
    assert line["logger"] == "torch.distributed.elastic.agent"
    assert not torch_logger.handlers
