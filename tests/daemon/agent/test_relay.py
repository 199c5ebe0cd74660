"""The ranks' output relayed by the daemon: files followed as they appear, whole lines, in order."""

from __future__ import annotations

import threading
from pathlib import Path

import structlog

from daemon.agent.relay import RankOutputRelay, RelayLogsSpecs
from tests.daemon._daemon_proc import wait_for


class _Lines:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)

    def get(self) -> list[str]:
        with self.lock:
            return list(self.lines)


def test_lines_are_relayed_whole_in_order_and_the_rest_on_close(tmp_path: Path) -> None:
    out = _Lines()
    relay = RankOutputRelay(out, poll_s=0.02).start()
    later = tmp_path / "attempt_0" / "0" / "stderr.log"
    relay.follow([str(later)])  # the rank has not created it yet
    later.parent.mkdir(parents=True)
    with later.open("wb", buffering=0) as f:
        f.write(b"first line\nsecond ")
        wait_for(lambda: out.get() == ["first line"], 10, "the first complete line")
        f.write(b"half\r\n\x1b[32mcoloured\x1b[0m \xff\nunterminated")
        wait_for(lambda: len(out.get()) == 3, 10, "three lines")
    relay.close()
    assert out.get() == [
        "first line",
        "second half",
        "\x1b[32mcoloured\x1b[0m \ufffd",
        "unterminated",  # printed by close()
    ]
    relay.close()  # idempotent
    assert len(out.get()) == 4


def test_a_failing_printer_loses_one_line_not_the_relay(tmp_path: Path) -> None:
    seen: list[str] = []

    def emit(line: str) -> None:
        if line == "bad":
            raise OSError("terminal gone")
        seen.append(line)

    path = tmp_path / "stdout.log"
    path.write_bytes(b"good\nbad\nafter\n")
    relay = RankOutputRelay(emit, poll_s=0.02)
    relay.follow([str(path)])
    with structlog.testing.capture_logs() as logs:
        relay.close()  # never started: close() still reads what is there
    assert seen == ["good", "after"]
    assert relay.num_lost_lines == 1
    assert [e["num_lines"] for e in logs if e["event"] == "rank_output_lines_lost"] == [1]


def test_logs_specs_redirect_every_rank_and_hand_each_attempt_to_the_relay(
    tmp_path: Path,
) -> None:
    followed: list[list[str]] = []

    class Recorder(RankOutputRelay):
        def follow(self, paths: list[str]) -> None:
            followed.append(paths)

    specs = RelayLogsSpecs(str(tmp_path / "elastic"), Recorder(lambda line: None))
    for attempt in ("0", "1"):
        envs = {
            r: {"TORCHELASTIC_RUN_ID": "run", "TORCHELASTIC_RESTART_COUNT": attempt}
            for r in range(2)
        }
        dest = specs.reify(envs)
        assert set(dest.stdouts) == set(dest.stderrs) == {0, 1}
        assert all(p.endswith("stdout.log") for p in dest.stdouts.values())
        assert all(p.endswith("stderr.log") for p in dest.stderrs.values())
        assert not dest.tee_stdouts  # the agent does not print them itself: the relay does
        assert not dest.tee_stderrs
        assert followed[-1] == [*dest.stdouts.values(), *dest.stderrs.values()]
        assert all(f"attempt_{attempt}" in p for p in followed[-1])
    assert len(followed) == 2
