"""`step()` leaves the ZeRO-1/2 weight all-gathers pending; every reader waits first (2 ranks).

See [Note: deferred weight gather] in `sharding/_optimizer.py`. The counters say which
reader waited on which bucket's gather, so the tests are deterministic; every read is
compared with an unwrapped reference trained on the global batch (rtol = atol = 1e-5, the
parity tolerance of test_parity.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sharding import Strategy
from tests.sharding._deferred_ranks import deferred_gathers
from tests.support.dist import run_on_ranks

DEFERRED = [Strategy.OPTIM, Strategy.OPTIM_GRADS]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _close_dicts(pair: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:
    got, want = pair
    assert got.keys() == want.keys()
    for key in want:
        _close(got[key], want[key])


@pytest.fixture(scope="module", params=DEFERRED, ids=lambda s: s.value)
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_on_ranks(deferred_gathers, 2, request.param, timeout_s=240)


@pytest.mark.slow
def test_step_returns_with_every_gather_pending(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert rank["pending_after_step"] == rank["num_buckets"] > 0


@pytest.mark.slow
def test_state_dict_right_after_step_waits_and_is_updated(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert rank["pending_after_state_dict"] == 0
        _close_dicts(rank["state_dict"])


@pytest.mark.slow
def test_parameter_read_waits_for_its_own_bucket_only(results: list[dict[str, Any]]) -> None:
    for rank in results:
        before, after = rank["pending_around_param_read"]
        assert (before, after) == (rank["num_buckets"], rank["num_buckets"] - 1)
        _close(*rank["param_read"])


@pytest.mark.slow
def test_forward_waits_unit_by_unit(results: list[dict[str, Any]]) -> None:
    for rank in results:
        run = rank["eval_forward"]
        # When block 0 starts, only the root's and block 0's gathers have been waited on.
        assert run["pending_in_block0"] == (
            rank["num_buckets"] - rank["root_buckets"] - rank["block0_buckets"]
        )
        assert run["pending_in_block0"] > 0
        # Reading block 2's weight from block 0's forward waits for that bucket (not stale).
        assert run["pending_after_early_read"] == run["pending_in_block0"] - 1
        _close(run["early_read"], run["early_read_truth"])
        assert run["pending_after"] == 0
        assert run["waited_in_forward"] == rank["num_buckets"] - 1


@pytest.mark.slow
def test_second_step_before_forward_waits_first(results: list[dict[str, Any]]) -> None:
    for rank in results:
        # The second step waited on every gather of the first; its own are pending.
        assert rank["double_step_waits"] == (rank["num_buckets"], rank["num_buckets"])
        _close_dicts(rank["double_step"])


@pytest.mark.slow
def test_training_loop_waits_every_gather_in_forward(results: list[dict[str, Any]]) -> None:
    for rank in results:
        run = rank["training"]
        # Three steps: the forwards of the last two wait on the gathers of the one before.
        assert run == {
            "in_forward": 2 * rank["num_buckets"],
            "elsewhere": 0,
            "pending": rank["num_buckets"],
        }
    weights, truth = results[0]["final"]
    _close_dicts((weights, {k: truth[k] for k in weights}))
