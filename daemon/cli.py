"""`trainingd` console script: `run`, `status`, `config show`, `prepare-data`."""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from daemon._config_load import add_config_flags, dump_toml, load_config
from daemon._version import distribution_version
from daemon.config import RankStart
from daemon.data import prepare as prepare_data
from daemon.errors import ConfigError
from daemon.observe import report as status_report

_EPILOG = """\
examples:
  trainingd run                         train the default job on this node
  trainingd run --config job.toml       train with settings from a TOML file
  trainingd run --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400
  trainingd run --nnodes 1:2 --node-rank 1 --rdzv-endpoint node0:29400
                                        elastic: the job goes on at 1 node when the other
                                        leaves and grows back to 2 when it returns
  trainingd status                      what the daemon on this node is doing, its incidents
  trainingd status --run-dir DIR        the same from a run directory, the daemon being down
  trainingd config show --max-steps 50  print the effective configuration
  trainingd --version

every config key is a flag (--max-steps), a TRAININGD_* variable (TRAININGD_MAX_STEPS) and a
key of the TOML file ([train] max_steps); precedence: flag > variable > file > default.
exit codes: 0 reached max_steps; 143 (130) stopped by SIGTERM (SIGINT) on this node, final
checkpoint committed; 75 stopped because another node was stopped, or the rendezvous store
was lost (restart me; with --nnodes MIN:MAX the other nodes go on instead); 1 workers failed
(max_restarts spent, or the same error at the same step twice); 2 bad config, start-up check,
or the job failed before training.
"""

EXIT_CONFIG = 2


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose "unrecognized arguments" error names the nearest known flag."""

    def _option_strings(self) -> Iterator[str]:
        for action in self._actions:
            yield from action.option_strings
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    if isinstance(sub, _Parser):
                        yield from sub._option_strings()

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments:"
        if message.startswith(prefix):
            known = sorted(set(self._option_strings()))
            for word in message.removeprefix(prefix).split():
                flag = word.split("=", 1)[0]
                close = difflib.get_close_matches(flag, known, n=1) if flag[:2] == "--" else []
                if close:
                    message += f" (did you mean {close[0]}?)"
                    break
        super().error(message)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="TOML config file (also $TRAININGD_CONFIG)",
    )
    add_config_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser (exposed for tests and docs)."""
    parser = _Parser(
        prog="trainingd",
        allow_abbrev=False,
        description="Per-node training daemon for distributed PyTorch.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"trainingd {distribution_version()}"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # allow_abbrev=False on every parser: a prefix such as --max-step is a usage error naming
    # --max-steps, never silently taken for it.
    run = sub.add_parser(
        "run",
        allow_abbrev=False,
        help="train on this node (one daemon per node)",
        description="Train on this node: launch local ranks, checkpoint, export metrics.",
    )
    _add_config_args(run)
    status = sub.add_parser(
        "status",
        allow_abbrev=False,
        help="summarize a running daemon (or its run directory): ranks, steps, incidents",
        description="Print a running daemon's status: run, phase, step, ranks, newest "
        "durable and memory steps, and its last incidents (what, where, detection and "
        "recovery seconds, steps lost). Exit 1 when no daemon answers.",
    )
    status.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="TOML config file whose metrics_host/metrics_port give the default --url "
        "(also $TRAININGD_CONFIG)",
    )
    status_report.add_arguments(status)
    config = sub.add_parser("config", help="inspect the configuration", allow_abbrev=False)
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION")
    show = config_sub.add_parser(
        "show",
        help="print the effective configuration (TOML) after flags, env and file",
        allow_abbrev=False,
    )
    _add_config_args(show)
    prepare = sub.add_parser(
        "prepare-data",
        allow_abbrev=False,
        help="turn text files into a token file for --data",
        description="Text files to one token file (.bin + .json sidecar): bytes, or a "
        "local tokenizers file's tokens.",
    )
    prepare_data.add_arguments(prepare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `trainingd` console script; returns the exit code."""
    started = time.monotonic()
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command is None:
        parser.print_help()
        return EXIT_CONFIG
    if command == "prepare-data":
        return prepare_data.run(args)
    if command == "status":
        return _status(args)
    if command == "config" and args.pop("config_command") is None:
        parser.parse_args(["config", "--help"])
    config_file = args.pop("config")
    try:
        cfg = load_config(args, file=config_file)
    except ConfigError as err:
        print(f"trainingd: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if command == "config":
        sys.stdout.write(dump_toml(cfg))
        return 0
    # The composition root of the daemon process: the agent launches the rank entry point
    # it is handed here, so neither side imports the other (`daemon/__init__.py`, layering).
    from daemon.worker import RANK_MODULES, elastic_entry

    if cfg.launch.rank_start is RankStart.FORK_SERVER:
        # Before this process imports torch: the server imports while the daemon does.
        from daemon.agent import fork_server

        entry_module = elastic_entry.__module__
        fork_server.launch(fork_server.preload_modules(cfg.train.job, entry_module, RANK_MODULES))
    from daemon.agent.run import run_daemon

    return run_daemon(cfg, elastic_entry, started=started, rank_modules=RANK_MODULES)


def _status(args: dict[str, object]) -> int:
    """`trainingd status`: the configuration only supplies the default URL and run id."""
    config_file = args.pop("config")
    try:
        cfg = load_config({}, file=config_file if isinstance(config_file, Path) else None)
    except ConfigError as err:
        print(f"trainingd: {err}", file=sys.stderr)
        return EXIT_CONFIG
    obs = cfg.observability
    return status_report.run(
        args, host=obs.metrics_host, port=obs.metrics_port, run_id=cfg.launch.run_id
    )


if __name__ == "__main__":
    sys.exit(main())
