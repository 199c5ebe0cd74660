"""The README's configuration and metrics references stay in step with the code."""

from __future__ import annotations

import pathlib

from daemon import metrics
from daemon._config_load import config_reference

README = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_config_row_is_in_the_readme() -> None:
    rows = [line for line in config_reference().splitlines() if line.startswith("| `[")]
    assert rows, "config_reference() produced no rows"
    missing = [row.split("|")[1].strip() for row in rows if row not in README]
    assert not missing, f"README configuration reference is stale for {missing}"


def test_every_metric_is_in_the_readme() -> None:
    missing = [spec.name for spec in metrics.CATALOG if f"`{spec.name}`" not in README]
    assert not missing, f"README metrics reference lacks {missing}"
