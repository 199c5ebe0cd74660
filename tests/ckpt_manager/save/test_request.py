"""One rank's save state machine: STAGING -> WRITING -> OK | FAILED, guarded in one place."""

from __future__ import annotations

import threading
import time

import pytest

from ckpt_manager._coord import Status
from ckpt_manager._format.shard_file import FileLayout
from ckpt_manager._save.request import InvalidTransitionError, Limits, SaveRequest, SaveState

_LIMITS = Limits(staging_s=5.0, start_s=5.0, write_s=5.0)


def _request(file_name: str | None = "rank-00000.bin") -> SaveRequest:
    return SaveRequest(
        request_id=7,
        step=70,
        created_unix_s=time.time(),
        started=time.monotonic(),
        slot=0,
        layout=FileLayout(b"", (), 0),
        file_name=file_name,
        contribution={},
    )


def test_the_happy_path_records_size_and_checksum() -> None:
    req = _request()
    assert req.state is SaveState.STAGING
    assert req.local_status(_LIMITS) == Status.WRITING
    assert req.start_writing()
    assert req.state is SaveState.WRITING
    assert req.dispatched is not None
    req.checksum = 456  # the staging copy's, set before the hand-off
    assert req.finish_ok(size=123)
    assert req.state is SaveState.OK
    assert req.contribution == {"size": 123, "crc32": 456, "checksum_algorithm": "crc32c"}
    assert req.local_status(_LIMITS) == Status.OK
    assert req.error is None


def test_a_written_file_without_a_staged_checksum_fails_the_save() -> None:
    req = _request()
    assert req.start_writing()
    assert not req.finish_ok(size=123)
    assert req.state is SaveState.FAILED
    assert req.error is not None
    assert "checksum" in req.error
    assert req.contribution == {}


def test_a_cancelled_save_answered_before_its_checksum_keeps_no_local_cause() -> None:
    req = _request()
    assert req.start_writing()
    req.cancel()  # the finalizer's abort path: the agreed cause is recorded later
    assert not req.finish_ok(size=123)  # the writer's answer, taken while aborting
    assert req.state is SaveState.FAILED
    assert req.error is None
    assert req.contribution == {}


def test_a_failed_save_ignores_late_news_and_keeps_its_first_cause() -> None:
    req = _request()
    req.fail("disk full")
    req.fail("second cause")
    assert req.state is SaveState.FAILED
    assert req.error == "disk full"
    assert not req.start_writing()  # the staging job must not dispatch it
    req.checksum = 2
    assert not req.finish_ok(size=1)  # a writer answering after the cancel
    assert req.contribution == {}
    assert req.local_status(_LIMITS) == Status.FAILED


def test_cancel_fails_without_a_local_cause_until_the_agreed_one_is_recorded() -> None:
    req = _request()
    assert req.start_writing()
    req.cancel()
    assert req.state is SaveState.FAILED
    assert req.error is None  # this rank did nothing wrong: all_gather sends None for it
    req.fail("rank 1: writer failed")
    assert req.error == "rank 1: writer failed"


def test_an_ok_part_can_still_fail_as_a_whole() -> None:
    req = _request(file_name=None)
    assert req.start_writing()
    assert req.finish_ok()
    req.fail("commit failed on the coordinator: manifest exists")
    assert req.state is SaveState.FAILED


@pytest.mark.parametrize(
    "steps",
    [
        ["finish_ok"],  # STAGING -> OK skips the writer
        ["start_writing", "start_writing"],  # dispatched twice
        ["start_writing", "finish_ok", "finish_ok"],  # answered twice
        ["start_writing", "finish_ok", "start_writing"],  # OK -> WRITING
    ],
    ids=["staging-ok", "writing-twice", "ok-twice", "ok-writing"],
)
def test_edges_outside_the_diagram_are_bugs(steps: list[str]) -> None:
    req = _request()
    *before, last = steps
    for name in before:
        assert getattr(req, name)()
    with pytest.raises(InvalidTransitionError, match="is not a transition"):
        getattr(req, last)()


def test_a_stuck_copy_fails_after_its_time_limit() -> None:
    req = _request()
    req.started -= 11.0  # staging_s + start_s = 10 s have passed
    assert req.local_status(_LIMITS) == Status.FAILED
    assert req.error == "snapshot copy did not finish within 5 s"


def test_a_staging_job_that_ends_without_a_writer_fails_instead_of_hanging() -> None:
    req = _request()
    assert req.start_writing()
    req.handed_off.set()  # e.g. the inline write raised something unexpected
    assert req.local_status(_LIMITS) == Status.FAILED
    assert req.error is not None
    assert "without handing the request to a writer" in req.error


def test_transitions_from_two_threads_take_exactly_one_edge() -> None:
    for _ in range(50):
        req = _request()
        barrier = threading.Barrier(2)
        results: list[bool] = []

        def dispatch(r: SaveRequest, b: threading.Barrier, out: list[bool]) -> None:
            b.wait()
            out.append(r.start_writing())

        thread = threading.Thread(target=dispatch, args=(req, barrier, results))
        thread.start()
        barrier.wait()
        req.cancel()
        thread.join()
        # Either the dispatch won (and the cancel then failed it) or it was refused.
        assert req.state is SaveState.FAILED
        assert results in ([True], [False])
