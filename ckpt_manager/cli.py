"""`ckptctl` console script.

Read-only commands must start fast: nothing here imports torch.distributed at module level.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata

_EPILOG = """\
examples:
  ckptctl --help
  ckptctl --version
"""


def _version() -> str:
    try:
        return metadata.version("trainingd")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="ckptctl",
        description="Inspect, verify, restore and prune trainingd checkpoints (local or s3://).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ckptctl {_version()}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ckptctl` console script; returns the exit code."""
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
