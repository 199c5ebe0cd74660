"""trainingd's per-node service: launches local ranks, trains, checkpoints, exports metrics.

`daemon` composes the two engines (`sharding`, `ckpt_manager`) and is the only package that
knows Prometheus, systemd and the elastic launcher. This import name is ours: trainingd never
depends on the unrelated `python-daemon` distribution (a test pins that `daemon` resolves here).

Module plan (filled in as the daemon lands):
    cli.py       `trainingd` console script (argparse), `--help`, `--version`, subcommands.
    _logging.py  structlog configuration shared by every process of a run.
    gpt.py       the default job's byte-level GPT (also used by tests and benchmarks).
"""

from daemon._logging import LogFormat, bind_process_context, configure_logging
from daemon.gpt import GPT, Block, GPTConfig, lm_loss

__all__ = [
    "GPT",
    "Block",
    "GPTConfig",
    "LogFormat",
    "bind_process_context",
    "configure_logging",
    "lm_loss",
]
