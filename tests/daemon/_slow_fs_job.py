"""A job for end-to-end tests: the default job, with `slowfile://` checkpoint roots available.

Importing this module registers `tests.support.slow_fs.SlowLocalFileSystem` with fsspec. The
daemon imports the job in its start-up check and every rank imports it before its checkpoint
manager opens the root, so `--ckpt-uri slowfile:///abs/path --job tests.daemon._slow_fs_job:build`
runs the default job on a local root whose checkpoint reads are as slow as
`$SLOWFS_READ_DELAY_S` says, and stuck while `$SLOWFS_PAUSE_FILE` exists. Use
`--async-mode sync`: a writer process imports no job, so it could not open the root.
"""

from __future__ import annotations

from daemon.jobs import default_job
from daemon.jobs.job import JobContext, JobSpec
from tests.support import slow_fs

slow_fs.register()


def build(ctx: JobContext) -> JobSpec:
    """The default job, unchanged."""
    return default_job.build(ctx)
