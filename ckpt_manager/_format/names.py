"""Names relative to a checkpoint root, checked before they touch storage.

Every name read from a manifest, an index or a listing passes here first (STYLE 13: no `..`,
no absolute paths), whichever backend then stores the bytes.
"""

from __future__ import annotations

__all__ = ["validate_relative_name"]


def validate_relative_name(name: str) -> str:
    """Check a name read from a manifest or a listing before it touches storage.

    Args:
        name: a `/`-separated path relative to the checkpoint root.

    Returns:
        The name unchanged.

    Raises:
        ValueError: empty, absolute, `..`/`.` components, backslashes, a URL scheme or NUL.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"invalid name {name!r}: empty or not a string")
    if name.startswith(("/", "~")) or "://" in name or "\\" in name or "\x00" in name:
        raise ValueError(f"invalid name {name!r}: must be relative to the checkpoint root")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"invalid name {name!r}: empty, '.' or '..' path component")
    return name
