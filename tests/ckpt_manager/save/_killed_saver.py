"""A one-rank training run that saves, then is SIGKILLed from outside at a chosen point.

    python -m tests.ckpt_manager.save._killed_saver \
        ROOT OPTIONS_JSON COMMIT_STEP KILL_STEP POINT READY [GO]

It restores the newest committed step (if any), saves `COMMIT_STEP` and waits for its commit,
then saves `KILL_STEP` and creates the file `READY` once the save has reached `POINT`:
- `staging`: `save()` returned (the copy may still run; nothing written yet);
- `writing`: the writer holds halfway (`CKPT_MANAGER_WRITER_FAULT=hold=...`, set by the test):
  a partial object lies under the root (in the step's folder, or under a spread prefix);
- `commit`: every file of the step is written, the manifest is not (nothing calls
  `maybe_finalize`, so nothing commits).
Then it sleeps until the test kills it. `KILL_STEP` 0 is a clean run instead: after the
commit it creates `READY`, waits for the file `GO`, saves `COMMIT_STEP + 2` and finishes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import torch

from ckpt_manager import CheckpointConfig, CheckpointManager
from ckpt_manager._format.layout import step_dir

_WAIT_S = 120.0


def main() -> None:
    root, options, commit_step, kill_step, point, ready = sys.argv[1:7]
    cfg = CheckpointConfig(storage_options=json.loads(options))
    state = {"w": torch.zeros(4096), "step": 0}
    with CheckpointManager(root, cfg, run_id="killed-saver") as mgr:
        mgr.restore(into=state)
        state["w"] += 1
        mgr.save(int(commit_step), state)
        mgr.wait_until_finished()
        if int(kill_step) == 0:
            Path(ready).write_text("committed")
            _wait_for(lambda: Path(sys.argv[7]).exists(), "the go file")
            mgr.save(int(commit_step) + 2, state)
            mgr.wait_until_finished()
            return
        mgr.save(int(kill_step), state)
        mgr.before_optimizer_step()
        if point != "staging":
            want = ".partial" if point == "writing" else ".index.json"
            fs, path = fsspec.core.url_to_fs(root, **json.loads(options))
            folder = step_dir(int(kill_step))
            _wait_for(
                lambda: any(
                    n.endswith(want) and (want == ".partial" or folder in n)
                    for n in _names(fs, path)
                ),
                f"*{want} for step {kill_step}",
            )
        Path(ready).write_text(point)
        time.sleep(3600)


def _wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"no {what} after {_WAIT_S} s")
        time.sleep(0.05)


def _names(fs: Any, path: str) -> list[str]:
    fs.invalidate_cache()
    return [str(n) for n in fs.find(path)]


if __name__ == "__main__":
    main()
