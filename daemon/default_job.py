"""`--job daemon.default_job:build`, the default job's documented name (`config.py`, README).

The job itself (a byte-level GPT on a generated corpus) is `daemon/jobs/default_job.py`; this
module keeps the name that configuration files and `trainingd config show` spell.
"""

from __future__ import annotations

from daemon.jobs.default_job import build

__all__ = ["build"]
