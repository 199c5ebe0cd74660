"""The status page at `/`, rendered by a real headless chromium against a real 2-rank run.

Chromium runs with every background service off and its own profile folder, and is pointed at
127.0.0.1 only. `--virtual-time-budget` lets the page's `fetch('/api/status')` finish before the
DOM is dumped (virtual time waits for pending network fetches).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from daemon.data import write_token_file
from tests.daemon._daemon_proc import DaemonProc, committed_steps, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.browser]

_CKPT_EVERY = 5
_ARGS = [
    "--nproc-per-node",
    "2",
    "--batch-size",
    "4",
    "--warmup-steps",
    "1",
    "--max-steps",
    "100000",
    "--ckpt-every",
    str(_CKPT_EVERY),
    "--keep-last",
    "0",  # keep all, so every step the table lists is still on disk when the test looks
]
SCREENSHOT_ENV = "TRAININGD_STATUS_SCREENSHOT"
"""Where to also write the test's screenshot (how docs/status-page.png is made)."""


def _chromium(url: str, profile: Path, *extra: str) -> str:
    cmd = [
        shutil.which("chromium") or "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--metrics-recording-only",
        "--disable-default-apps",
        "--disable-extensions",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        "--window-size=1000,1100",
        *extra,
        url,
    ]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


class Rendered(NamedTuple):
    """What the rendered page shows."""

    points: int
    polyline: int
    step: int
    max_steps: int
    eta: str
    checkpoints: list[int]
    num_ranks: int
    durable_step: str
    memory_step: str
    memory_bytes: str
    val_points: int
    val_polyline: int
    val_loss: str


def _load(url: str, profile: Path, *extra: str) -> Rendered:
    """Render the page and read what it shows (`extra`: more chromium flags, same load)."""
    dom = _chromium(url, profile, "--dump-dom", *extra)
    assert 'data-loaded="1"' in dom, dom[-3000:]
    points = re.search(r'id="loss-curve"[^>]*data-points="(\d+)"', dom)
    line = re.search(r'id="loss-line"[^>]*points="([^"]*)"', dom)
    step = re.search(r'id="step">step (\d+)/(\d+)<', dom)
    eta = re.search(r'id="eta">([^<]*)<', dom)
    table = re.search(r'<table id="checkpoints">.*?<tbody>(.*?)</tbody>', dom, re.S)
    ranks = re.search(r'<table id="ranks">.*?<tbody>(.*?)</tbody>', dom, re.S)
    durable_step = re.search(r'id="durable-step">([^<]*)<', dom)
    memory_step = re.search(r'id="memory-step">([^<]*)<', dom)
    memory_bytes = re.search(r'id="memory-bytes">([^<]*)<', dom)
    val_line = re.search(r'id="val-loss-line"[^>]*points="([^"]*)"[^>]*data-points="(\d+)"', dom)
    val_loss = re.search(r'id="val-loss">([^<]*)<', dom)
    assert val_line is not None, dom[-3000:]
    assert val_loss is not None, dom[-3000:]
    assert points is not None, dom[-3000:]
    assert line is not None, dom[-3000:]
    assert step is not None, dom[-3000:]
    assert eta is not None, dom[-3000:]
    assert table is not None, dom[-3000:]
    assert ranks is not None, dom[-3000:]
    assert durable_step is not None, dom[-3000:]
    assert memory_step is not None, dom[-3000:]
    assert memory_bytes is not None, dom[-3000:]
    ckpt_steps = [int(s) for s in re.findall(r'<tr><td class="n">(\d+)</td>', table.group(1))]
    return Rendered(
        points=int(points.group(1)),
        polyline=len(line.group(1).split()),
        step=int(step.group(1)),
        max_steps=int(step.group(2)),
        eta=eta.group(1),
        checkpoints=ckpt_steps,
        num_ranks=ranks.group(1).count("<tr>"),
        durable_step=durable_step.group(1),
        memory_step=memory_step.group(1),
        memory_bytes=memory_bytes.group(1),
        val_points=int(val_line.group(2)),
        val_polyline=len(val_line.group(1).split()),
        val_loss=val_loss.group(1),
    )


def _api(d: DaemonProc) -> dict[str, Any]:
    code, body = d.get("/api/status")
    assert code == 200, body
    return dict(json.loads(body))


def test_status_page_in_a_real_browser(tmp_path: Path, procs: list[DaemonProc]) -> None:
    root = tmp_path / "ckpt"
    # A validation file of random bytes (the default GPT's vocabulary), evaluated every 5 steps.
    val = tmp_path / "val.bin"
    tokens = np.random.default_rng(0).integers(0, 256, 4096)
    write_token_file(str(val), [tokens], vocab_size=256)
    evals = ["--val-data", str(val), "--eval-every", "5", "--eval-batches", "1"]
    d = DaemonProc(tmp_path, [*_ARGS, "--ckpt-uri", str(root), *evals])
    procs.append(d)

    def enough() -> bool:
        assert d.exit_code() is None, d.logs()
        s = _api(d)
        return len(s["loss"]) >= 20 and bool(s["checkpoints"]["committed"]) and bool(s["val_loss"])

    wait_for(enough, 240, "20 loss points, a val loss and a committed checkpoint on /api/status")
    assert d.get("/metrics")[0] == 200  # the other endpoints are unchanged
    assert d.get("/readyz")[0] == 200

    first = _load(d.url + "/", tmp_path / "profile")
    assert first.points >= 20, first
    assert first.polyline == first.points
    assert first.max_steps == 100000
    assert first.eta != "-", first
    # The validation loss: its card (value @ step) and its points on the loss curve.
    assert first.val_points >= 1, first
    assert first.val_polyline == (first.val_points if first.points >= 2 else 0), first
    assert re.fullmatch(r"\d+\.\d{4} @\d+", first.val_loss), first
    assert first.num_ranks == 2, first
    table = first.checkpoints
    assert table, first
    # Scheduled steps, or a save deferred behind the previous write and taken a step later.
    caught_up = {int(e["ckpt_step"]) for e in d.find("checkpoint_caught_up")}
    assert all(s % _CKPT_EVERY == 0 or s in caught_up for s in table), (table, caught_up)
    # The tiers: the newest durable and memory steps, the memory tier's bytes (local / replica).
    assert first.durable_step.isdigit(), first
    assert first.memory_step.isdigit(), first
    assert re.fullmatch(r"\d[\d.]* [KMG]?i?B / 0 B", first.memory_bytes), first
    on_disk = committed_steps(root)
    assert set(table) <= set(on_disk), (table, on_disk)
    # The page lists every committed step up to its newest one (refreshed every few seconds).
    assert sorted(table) == [s for s in on_disk if s <= max(table)], (table, on_disk)

    before = first.step
    wait_for(lambda: (_api(d)["step"] or 0) > before, 60, "the step to advance")
    shot = tmp_path / "status.png"
    # One chromium load gives both the DOM and the screenshot.
    second = _load(d.url + "/", tmp_path / "profile", f"--screenshot={shot}")
    assert second.step > before, (first, second)
    assert shot.stat().st_size > 10_000
    if os.environ.get(SCREENSHOT_ENV):
        shutil.copyfile(shot, os.environ[SCREENSHOT_ENV])

    d.signal(signal.SIGTERM)
    assert d.wait(120) == 128 + signal.SIGTERM, d.logs()  # stopped here, checkpoint committed
