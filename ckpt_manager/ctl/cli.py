"""`ckptctl` console script: list, show, verify, restore, prune, pin and unpin checkpoints.

Commands live in the other `ctl/` modules; this module parses the command line, opens
storage, prints, and maps failures to exit codes (0 ok, 1 the operation failed, 2 usage error)
and one-line messages (`--debug` adds the traceback). Read-only commands start fast:
torch.distributed is never initialised and the argument parser imports nothing heavy (see
[Note: import cost]).

[Note: import cost] `--help`, `--version` and usage errors import no `ckpt_manager` module
but the retention registry and its policies (`_retention/registry.py`, `policies/`: the
standard library only), which the retention flags are made from. `list`, `show`, `verify`,
`prune`, `pin` and `unpin` import only torch-free modules: manifests are validated with the
dtype table in `_format/dtypes.py` (a CLI test runs list/show/verify/prune/pin and asserts
torch was never imported). Only `restore` imports torch, because it makes tensors
(consolidated exports, resharding).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

__all__ = ["build_parser", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_EPILOG = """\
examples:
  ckptctl list /data/ckpt/run-7
  ckptctl list s3://bucket/runs/7 --endpoint-url http://127.0.0.1:8333 --json
  ckptctl show /data/ckpt/run-7 latest
  ckptctl verify s3://bucket/runs/7 --all
  ckptctl restore /data/ckpt/run-7 latest --only model --to model.pt
  ckptctl restore s3://bucket/runs/7 1000 --world-size 3 --to /data/ckpt/run-8
  ckptctl prune /data/ckpt/run-7 --keep-last 3 --keep-every 1000 --dry-run
  ckptctl pin /data/ckpt/run-7 1000

storage: s3:// URIs use the standard AWS credential chain (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/config); --profile, --endpoint-url, --region
and --anon override it. Global options may come before or after the command.
exit codes: 0 ok, 1 the operation failed (e.g. verify found damage), 2 usage error.
"""

_EXAMPLES = {
    "list": """\
examples:
  ckptctl list /data/ckpt/run-7
  ckptctl list /data/ckpt/run-7 --all --verify
  ckptctl list s3://bucket/runs/7 --keep-last 3 --keep-every 1000
  ckptctl list s3://bucket/runs/7 --json | jq '.[] | select(.state == "committed") | .step'
""",
    "show": """\
examples:
  ckptctl show /data/ckpt/run-7            # the newest committed step
  ckptctl show s3://bucket/runs/7 1000 --json
""",
    "verify": """\
examples:
  ckptctl verify /data/ckpt/run-7          # the newest committed step
  ckptctl verify /data/ckpt/run-7 1000
  ckptctl verify s3://bucket/runs/7 --all  # exit 1 and a list of bad files on damage
""",
    "restore": """\
examples:
  ckptctl restore /data/ckpt/run-7 latest --only model --to model.pt
      python -c "import torch; m.load_state_dict(torch.load('model.pt', weights_only=True))"
  ckptctl restore s3://bucket/runs/7 1000 --format safetensors --only model --to model.safetensors
  ckptctl restore s3://bucket/runs/7 1000 --format safetensors --only model \\
      --max-shard-size 2GB --to hf-model/      (sharded, with model.safetensors.index.json)
  ckptctl restore /data/ckpt/run-7 latest --format dcp --to dcp-ckpt/   (for dcp.load)
  ckptctl restore /data/ckpt/run-7 latest --to s3://bucket/export/full.pt
  ckptctl restore s3://bucket/runs/7 1000 --world-size 3 --to /data/ckpt/run-8
      (then CheckpointManager('/data/ckpt/run-8').restore(into=...) on 3 ranks)
""",
    "prune": """\
examples:
  ckptctl prune /data/ckpt/run-7 --keep-last 3 --dry-run
  ckptctl prune s3://bucket/runs/7 --keep-last 2 --keep-every 1000
  ckptctl prune /data/ckpt/run-7 --keep-best 2 --metric loss --mode min --keep-last 1
  ckptctl prune /data/ckpt/run-7 --corrupt --dry-run   (quarantined and corrupt steps)
""",
    "pin": """\
examples:
  ckptctl pin /data/ckpt/run-7 1000
  ckptctl pin s3://bucket/runs/7 1000 2000
""",
    "unpin": """\
examples:
  ckptctl unpin /data/ckpt/run-7 1000
""",
}


def _version() -> str:
    try:
        return metadata.version("trainingd")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # On subcommands the defaults are SUPPRESSed so they never overwrite a value given
    # before the command (argparse copies subparser defaults over the namespace).
    default: Any = None if top else argparse.SUPPRESS
    group = parser.add_argument_group("storage and output (any position)")
    group.add_argument(
        "--endpoint-url",
        default=default,
        metavar="URL",
        help="S3-compatible endpoint, e.g. http://127.0.0.1:8333",
    )
    group.add_argument(
        "--profile",
        default=default,
        metavar="NAME",
        help="AWS profile (default: environment credentials / AWS_PROFILE)",
    )
    group.add_argument("--region", default=default, metavar="NAME", help="AWS region")
    group.add_argument(
        "--anon",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="unsigned S3 requests (public buckets)",
    )
    group.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="show tracebacks and debug logs",
    )


def _retention_options(parser: argparse.ArgumentParser) -> None:
    # One flag per parameter of each registered policy (`_retention/registry.py`); the dest is
    # the parameter's configuration key, the keyword `RetentionFlags` takes.
    import enum

    from ckpt_manager._retention.options import flag_help
    from ckpt_manager._retention.registry import specs

    group = parser.add_argument_group("retention (the manager's policies, combined by union)")
    for spec in specs():
        for param in spec.params:
            is_enum = issubclass(param.value_type, enum.Enum)
            group.add_argument(
                param.flag,
                dest=param.key,
                type=str if is_enum else param.value_type,
                choices=[str(m.value) for m in param.value_type] if is_enum else None,
                metavar=param.metavar,
                help=flag_help(spec, param).replace("%", "%%"),
            )


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="ckptctl",
        allow_abbrev=False,
        description="Inspect, verify, restore and prune trainingd checkpoints (local or s3://).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ckptctl {_version()}")
    _global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            allow_abbrev=False,
            help=text,
            description=text,
            epilog=_EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("uri", metavar="URI", help="checkpoint root: path or s3://bucket/prefix")
        _global_options(p, top=False)
        return p

    p = command("list", "One row per step: state, commit time, size, metrics, retention.")
    p.add_argument("--all", action="store_true", help="include uncommitted step folders")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also re-read every file (size, crc32); damaged steps show as corrupt",
    )
    p.add_argument(
        "--json", action="store_true", help="a JSON array (keys: see the README, ckptctl list)"
    )
    _retention_options(p)

    p = command("show", "A step's manifest: files, tensors, metrics, versions.")
    p.add_argument("step", nargs="?", default="latest", metavar="STEP|latest")
    p.add_argument("--json", action="store_true", help="JSON instead of text")

    p = command("verify", "Re-read files and check sizes and checksums (exit 1 on damage).")
    p.add_argument("step", nargs="?", default=None, metavar="STEP|latest")
    p.add_argument("--all", action="store_true", help="every step folder under the root")
    p.add_argument("--json", action="store_true", help="JSON instead of text")

    p = command("restore", "Materialise a step: one full state dict file, or N rank files.")
    p.add_argument("step", nargs="?", default="latest", metavar="STEP|latest")
    p.add_argument(
        "--to",
        required=True,
        metavar="PATH",
        help="output file (--format) or checkpoint root (--world-size); path or s3://",
    )
    p.add_argument(
        "--format",
        choices=("torch", "safetensors", "dcp"),
        default=None,
        help="one consolidated file (default torch unless --world-size); dcp: a torch DCP "
        "checkpoint directory",
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        default=None,
        help="with --format safetensors: Hugging Face sharded files of at most SIZE (e.g. "
        "2GB, 500MB) plus model.safetensors.index.json in the directory --to",
    )
    p.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="reshard into a committed checkpoint of N rank files under --to (holds --to's "
        "lease while writing: refused while a live run holds it)",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="KEY",
        help="keep this top-level entry (repeatable); one KEY becomes the file's "
        "top level, e.g. --only model for model.load_state_dict",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument(
        "--buffer-mib",
        type=int,
        default=64,
        metavar="MIB",
        help="read chunk size (default 64); memory stays within a few chunks",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="check file sizes only, skip the checksum pass (one read of the step less)",
    )

    p = command("prune", "Apply retention offline; never deletes the newest committed step.")
    _retention_options(p)
    p.add_argument("--dry-run", action="store_true", help="print what would go, delete nothing")
    p.add_argument(
        "--corrupt",
        action="store_true",
        help="instead of retention: delete the quarantined steps (_quarantine/) and every "
        "step that fails verification (reads every step back)",
    )
    p.add_argument(
        "--force", action="store_true", help="prune even while a live run holds the root"
    )
    p.add_argument("--json", action="store_true", help="JSON instead of text")

    for name, text in (
        ("pin", "Protect steps from retention (the manager honours pins)."),
        ("unpin", "Remove pins."),
    ):
        p = command(name, text)
        p.add_argument("steps", nargs="+", type=int, metavar="STEP")
    return parser


def _configure_logging(debug: bool) -> None:
    import logging

    import structlog

    class _StderrLogger(structlog.PrintLogger):
        # Resolve sys.stderr at each write, not once at configure time: `main()` also runs
        # in-process (tests, embedding) where the stderr of that moment is closed later.
        def msg(self, message: str) -> None:
            print(message, file=sys.stderr, flush=True)

        log = debug = info = warn = warning = err = error = critical = exception = msg
        fatal = failure = msg

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if debug else logging.WARNING
        ),
        logger_factory=lambda *_: _StderrLogger(),
        cache_logger_on_first_use=False,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ckptctl` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version (0) and usage errors (2)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    debug = bool(getattr(args, "debug", False))
    _configure_logging(debug)
    from ckpt_manager.ctl.common import describe_error
    from ckpt_manager.ctl.errors import UsageError

    try:
        handler: Callable[[argparse.Namespace], int] = _HANDLERS[args.command]
        return handler(args)
    except KeyboardInterrupt:
        print("ckptctl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`ckptctl list | head`): stop quietly, and keep Python from
        # complaining again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except (UsageError, ValueError) as err:
        if debug:
            traceback.print_exc()
        print(f"ckptctl: error: {describe_error(err)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:
        if debug:
            traceback.print_exc()
        print(f"ckptctl {args.command}: error: {describe_error(err)}", file=sys.stderr)
        return EXIT_FAILED


def _flags(args: argparse.Namespace) -> Any:
    from ckpt_manager.ctl.common import StorageFlags

    return StorageFlags(
        endpoint_url=getattr(args, "endpoint_url", None),
        profile=getattr(args, "profile", None),
        region=getattr(args, "region", None),
        anon=bool(getattr(args, "anon", False)),
    )


def _retention(args: argparse.Namespace) -> Any:
    from ckpt_manager._retention.registry import specs
    from ckpt_manager.ctl.retention import RetentionFlags

    return RetentionFlags(**{p.key: getattr(args, p.key) for s in specs() for p in s.params})


def _print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=1, allow_nan=True)
    sys.stdout.write("\n")


def _list(args: argparse.Namespace) -> int:
    from ckpt_manager.ctl.common import open_root
    from ckpt_manager.ctl.list import collect_rows, lease_header, render_rows

    retention = _retention(args)
    storage = open_root(args.uri, _flags(args))
    rows = collect_rows(storage, include_uncommitted=args.all, verify=args.verify, flags=retention)
    now = time.time()
    if args.json:
        _print_json([r.to_json(now) for r in rows])
        return EXIT_OK
    header = lease_header(storage, now)
    if header:
        print(header)
    print(render_rows(rows, now) if rows else f"no checkpoints under {args.uri}")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    from ckpt_manager.ctl.common import open_root, resolve_step
    from ckpt_manager.ctl.inspect import render_manifest, show_json

    storage = open_root(args.uri, _flags(args))
    _, manifest = resolve_step(storage, args.step)
    if args.json:
        _print_json(show_json(storage, manifest))
    else:
        print(render_manifest(storage, manifest))
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
    from ckpt_manager.ctl.common import LATEST, open_root, resolve_step
    from ckpt_manager.ctl.errors import UsageError
    from ckpt_manager.ctl.inspect import newest_committed_step, render_checks, verify_steps

    if args.all and args.step is not None:
        raise UsageError("give a STEP or --all, not both")
    storage = open_root(args.uri, _flags(args))
    steps: list[int] | None = None
    if args.step is None or args.step == LATEST:
        steps = None if args.all else [newest_committed_step(storage)]
    else:
        step = _step_number(args.step)
        # Only the manifest's presence decides: a damaged manifest, index or shard is the
        # verdict's to report (`corrupt`), never an error before it.
        if not storage.exists(f"{step_dir(step)}/{MANIFEST_NAME}"):
            resolve_step(storage, step)  # raises StepNotFoundError naming the nearest steps
        steps = [step]
    checks = verify_steps(storage, steps)
    if args.json:
        _print_json([c.to_json() for c in checks])
    else:
        print(render_checks(checks) if checks else f"no step folders under {args.uri}")
    return EXIT_FAILED if any(c.status == "corrupt" for c in checks) else EXIT_OK


def _step_number(spec: str) -> int:
    from ckpt_manager.ctl.errors import UsageError

    try:
        step = int(spec)
    except ValueError:
        raise UsageError(f"step {spec!r}: use a step number or 'latest'") from None
    if step < 0:
        raise UsageError(f"step {step}: steps are >= 0")
    return step


def _restore(args: argparse.Namespace) -> int:
    from ckpt_manager.ctl.restore import RestoreRequest, run_restore

    request = RestoreRequest(
        uri=args.uri,
        step=args.step,
        to=args.to,
        format=args.format,
        max_shard_size=args.max_shard_size,
        world_size=args.world_size,
        only=tuple(args.only),
        overwrite=args.force,
        chunk_bytes=args.buffer_mib << 20,
        verify_checksums=not args.no_verify,
    )
    for line in run_restore(request, _flags(args)):
        print(line)
    return EXIT_OK


def _prune(args: argparse.Namespace) -> int:
    from ckpt_manager.ctl.common import open_root
    from ckpt_manager.ctl.prune import apply_prune, check_lease, plan_prune, render_plan

    retention = _retention(args)
    storage = open_root(args.uri, _flags(args))
    if args.corrupt:
        return _prune_corrupt(args, storage, retention)
    if not args.dry_run:
        check_lease(storage, force=args.force)
    plan = plan_prune(storage, retention)
    results = [] if args.dry_run else apply_prune(storage, plan)
    failed = [(s, e) for s, e in results if e]
    if args.json:
        _print_json(
            {
                "dry_run": args.dry_run,
                "delete": [m.step for m in plan.delete],
                "keep": [{"step": s, "retained_by": why} for s, why in plan.keep],
                "skipped": [{"step": s, "reason": why} for s, why in plan.skipped],
                "failed": [{"step": s, "error": e} for s, e in failed],
            }
        )
    else:
        print(render_plan(plan, dry_run=args.dry_run))
        for step, error in failed:
            print(f"failed to delete step {step}: {error}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _prune_corrupt(args: argparse.Namespace, storage: Any, retention: Any) -> int:
    from ckpt_manager.ctl.errors import UsageError
    from ckpt_manager.ctl.prune import (
        apply_corrupt,
        check_lease,
        corrupt_json,
        plan_corrupt,
        render_corrupt,
    )

    if retention.given:
        raise UsageError("--corrupt deletes quarantined and corrupt steps: give no retention flag")
    if not args.dry_run:
        check_lease(storage, force=args.force)
    plan = plan_corrupt(storage)
    results = [] if args.dry_run else apply_corrupt(storage, plan)
    failed = [(w, e) for w, e in results if e]
    if args.json:
        _print_json(corrupt_json(plan, failed, dry_run=args.dry_run))
    else:
        print(render_corrupt(plan, dry_run=args.dry_run))
        for what, error in failed:
            print(f"failed to delete {what}: {error}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _pin(args: argparse.Namespace) -> int:
    from ckpt_manager.ctl.common import open_root, resolve_step
    from ckpt_manager.ctl.prune import pin, unpin

    storage = open_root(args.uri, _flags(args))
    if args.command == "pin":
        for step in args.steps:
            resolve_step(storage, step)
        lines = pin(storage, args.steps)
    else:
        lines = unpin(storage, args.steps)
    print("\n".join(lines))
    return EXIT_OK


_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "list": _list,
    "show": _show,
    "verify": _verify,
    "restore": _restore,
    "prune": _prune,
    "pin": _pin,
    "unpin": _pin,
}


if __name__ == "__main__":
    sys.exit(main())
