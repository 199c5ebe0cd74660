"""A run whose root already holds `max_steps` ends at once, unless that step fails verification.

The agent answers "already at step N" without starting a rank (`tests/daemon/test_ending.py`
checks the whole run); a final step whose bytes are damaged is no finished run: the agent
trains, and the ranks quarantine it and save it again (the restore path of #32, covered in
`tests/ckpt_manager/load/test_quarantine.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ckpt_manager import CheckpointConfig, CheckpointManager, verify_committed_step
from daemon._config_load import load_config
from daemon.agent.run import _already_complete


def test_a_final_step_that_fails_verification_is_not_complete(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(str(root), CheckpointConfig(), run_id="r") as mgr:
        mgr.save(3, {"w": torch.arange(1000, dtype=torch.float32)})
        mgr.wait_until_finished()
    cfg = load_config({"ckpt_uri": str(root), "max_steps": "3"}, env={})
    assert verify_committed_step(str(root), 3) is None
    assert _already_complete(cfg) == (
        f"trainingd: already at step 3 of 3 in {root}; "
        "pass --max-steps N to train further, or a new --ckpt-uri"
    )
    assert _already_complete(load_config({"ckpt_uri": str(root), "max_steps": "4"}, env={})) is None

    (shard,) = root.glob("step-*3/rank-00000.bin")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    problem = verify_committed_step(str(root), 3)
    assert problem is not None
    assert "checksum" in problem, problem
    assert _already_complete(cfg) is None
    assert verify_committed_step(str(root), 5) == "step 5 is not committed"
