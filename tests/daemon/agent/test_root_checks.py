"""The checkpoint root's checks of a node of a multi-node job run in its first round, and not
when it joins a job that already ran one ([Note: a node joining a running job skips the root
checks] in `daemon/agent/root_checks.py`).

The root is an S3 URI whose endpoint refuses connections (nothing listens on 127.0.0.1:9): a
check that runs fails at once, one that is skipped touches nothing. The inner hook stands for
the replica ring's exchange, which returns the job's round (`replica/service.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from daemon._config_load import load_config
from daemon.agent.root_checks import FirstRoundRootChecks
from daemon.errors import StartupCheckError

_NODE_1_OF_2 = {
    "nnodes": "2",
    "node_rank": 1,
    "rdzv_endpoint": "127.0.0.1:9",
    "ckpt_uri": "s3://bucket/run",
    "s3_endpoint_url": "http://127.0.0.1:9",
}


def _rounds(*numbers: int | None) -> Callable[..., int | None]:
    """An inner hook answering these rounds, one per call."""
    answers = list(numbers)

    def hook(store: Any, group_rank: int, num_nodes: int, ranks: list[int], world: int) -> Any:
        return answers.pop(0)

    return hook


def test_a_node_joining_a_job_that_already_ran_a_round_checks_nothing() -> None:
    cfg = load_config(dict(_NODE_1_OF_2), env={})
    hook = FirstRoundRootChecks(cfg, _rounds(4, 1, None))
    assert hook(None, 1, 2, [1], 2) == 4  # a fresh node replacing a lost one: round 4
    # Its later rounds are rounds of a job it is in: nothing is checked either.
    assert hook(None, 1, 2, [1], 2) == 1
    assert hook(None, 0, 1, [0], 1) is None


@pytest.mark.parametrize("first_round", [1, None], ids=["round-1", "round-unknown"])
def test_the_first_round_of_a_job_checks_the_root(first_round: int | None) -> None:
    cfg = load_config(dict(_NODE_1_OF_2), env={})
    hook = FirstRoundRootChecks(cfg, _rounds(first_round, 2))
    with pytest.raises(StartupCheckError, match=r"ckpt_uri='s3://bucket/run': .*unreachable"):
        hook(None, 1, 2, [1], 2)
    assert hook(None, 1, 2, [1], 2) == 2  # decided once, in this daemon's first round
