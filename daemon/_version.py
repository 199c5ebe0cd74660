"""The installed distribution's version, read once from package metadata."""

from __future__ import annotations

from importlib import metadata


def distribution_version() -> str:
    """Return trainingd's version, or `0+unknown` when run from a bare source tree."""
    try:
        return metadata.version("trainingd")
    except metadata.PackageNotFoundError:
        return "0+unknown"
