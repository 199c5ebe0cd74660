"""The checkpoint root's fsspec options, from the configuration (both processes use them).

The daemon lists and checks the root (`agent/preflight.py`, `agent/run.py`, the status page's
checkpoint list); every rank opens it through `ckpt_manager` (`rank/loop.py`). Both must talk to
the same endpoint, so both take the options from here. The ranks read `--data` token files
(`rank/token_data.py`) with the same S3 endpoint.
"""

from __future__ import annotations

from typing import Any

from ckpt_manager import S3Options
from daemon.config import DaemonConfig
from daemon.errors import StartupCheckError

__all__ = ["data_storage_options", "s3_storage_options"]


def _s3_endpoint(cfg: DaemonConfig) -> S3Options:
    """The S3 endpoint of the checkpoint root: from config, else `$AWS_ENDPOINT_URL`, else AWS.

    Raises:
        StartupCheckError: `$AWS_ENDPOINT_URL` has no http(s) scheme (the config's own
            `s3_endpoint_url` is validated when the config is loaded).
    """
    try:
        return S3Options.with_environment_endpoint(cfg.checkpoint.s3_endpoint_url or None)
    except ValueError as err:
        raise StartupCheckError(f"$AWS_ENDPOINT_URL: {err}") from None


def s3_storage_options(cfg: DaemonConfig, component: str = "agent") -> dict[str, Any]:
    """fsspec options for the checkpoint root (empty unless it is an `s3://` URI).

    `component` names the caller in each request's User-Agent (`trainingd-rank/<restart>.<pid>`,
    `trainingd-status`, `trainingd-agent`): an object store's access log then tells a
    restarted rank's restore from the status page's listing and from the reads of the
    incarnation it replaced.
    """
    return _named(_s3_endpoint(cfg).fsspec_options(cfg.checkpoint.ckpt_uri), component)


def _named(options: dict[str, Any], component: str) -> dict[str, Any]:
    if not options:
        return options
    config = dict(options.get("config_kwargs") or {})
    config["user_agent_extra"] = f"trainingd-{component}"
    return {**options, "config_kwargs": config}


def data_storage_options(cfg: DaemonConfig, uri: str) -> dict[str, Any]:
    """fsspec options for a `--data` token file: the checkpoint root's S3 endpoint for `s3://`.

    Token files and checkpoints usually live on the same object store, so the data side reads
    with the same endpoint (`[checkpoint] s3_endpoint_url`, else `$AWS_ENDPOINT_URL`).
    """
    return _named(_s3_endpoint(cfg).fsspec_options(uri), "data")
