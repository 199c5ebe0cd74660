"""`--job`: a module next to the current directory, or a file path, names the job callable."""

from __future__ import annotations

import pathlib
import sys
import uuid

import pytest

from daemon._config_load import load_config
from daemon.agent.fork_server import preload_modules
from daemon.errors import JobError
from daemon.jobs.job import job_module_name, load_job

_JOB = """
import dataclasses
from helper import VALUE

@dataclasses.dataclass
class Settings:
    value: int = VALUE

def build(ctx):
    return Settings().value
"""


@pytest.fixture
def job_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """A folder with a job module and the neighbour it imports; sys.path/modules restored."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "helper.py").write_text("VALUE = 7\n")
    return tmp_path


def test_a_module_next_to_the_current_directory(
    job_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"my_job_{uuid.uuid4().hex[:8]}"
    (job_dir / f"{name}.py").write_text("def build(ctx):\n    return 3\n")
    monkeypatch.chdir(job_dir)
    assert load_job(f"{name}:build")(None) == 3  # type: ignore[arg-type]
    assert job_module_name(f"{name}:build") == name


@pytest.mark.parametrize("form", ["absolute", "relative"])
def test_a_file_path(job_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    (job_dir / "jobs" / "my-job.py").write_text(_JOB)
    monkeypatch.chdir(job_dir)
    path = "jobs/my-job.py" if form == "relative" else str(job_dir / "jobs" / "my-job.py")
    build = load_job(f"{path}:build")
    assert build(None) == 7  # type: ignore[arg-type]  # its neighbour imported, a dataclass
    assert job_module_name(f"{path}:build") == "trainingd_job_my_job"
    assert sys.modules["trainingd_job_my_job"].build is build
    assert load_job(f"{path}:build") is build  # loaded once


def test_bad_jobs_are_one_clear_error(job_dir: pathlib.Path) -> None:
    (job_dir / "jobs" / "broken.py").write_text("raise RuntimeError('boom')\n")
    cases = {
        "no_such_module_xyz:build": "cannot import no_such_module_xyz",
        f"{job_dir}/jobs/missing.py:build": "no such file",
        f"{job_dir}/jobs/helper.py:build": "has no callable 'build'",
        f"{job_dir}/jobs/broken.py:build": "RuntimeError: boom",
        "build": "expected module:callable or path/to/job.py:callable",
    }
    for target, message in cases.items():
        with pytest.raises(JobError, match=message):
            load_job(target)


def test_run_id_and_preload_of_a_file_job() -> None:
    cfg = load_config({"job": "jobs/my_job.py:build"}, env={})
    assert cfg.run_id.startswith("my-job-")
    assert load_config({"job": "pkg.my_job:build"}, env={}).run_id.startswith("my-job-")
    modules = preload_modules("jobs/my_job.py:build", "daemon.worker", ())
    assert not any("my_job" in m for m in modules)
    assert "pkg.my_job" in preload_modules("pkg.my_job:build", "daemon.worker", ())
