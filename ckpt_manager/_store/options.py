"""fsspec options for `s3://` checkpoint roots, built in one place.

The daemon (its start-up checks and the manager's `storage_options`) and `ckptctl` (its global
`--endpoint-url/--profile/--region/--anon` flags) both describe an S3 endpoint; this module is
the only one that turns such a description into s3fs's keyword arguments, so a new option or
an object-store quirk is handled once. Which URIs are S3 roots is the backend registry's
answer (`_store/backends/`), not a list kept here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["ENDPOINT_ENV", "S3Options"]

ENDPOINT_ENV = "AWS_ENDPOINT_URL"
"""The AWS SDKs' standard variable for an S3-compatible endpoint."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class S3Options:
    """How to reach an S3-compatible object store; `fsspec_options` turns it into s3fs kwargs."""

    endpoint_url: str | None = None
    """S3-compatible endpoint (`http://127.0.0.1:8333`); None: AWS's default."""
    profile: str | None = None
    """AWS profile from `~/.aws/config`; None: environment credentials or the default chain."""
    anon: bool = False
    """Unsigned requests (public buckets); no credentials are looked up."""
    region: str | None = None
    """AWS region; None: from the environment or profile."""

    def __post_init__(self) -> None:
        if self.anon and self.profile:
            raise ValueError("anonymous access and a profile exclude each other: drop one")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"endpoint {self.endpoint_url!r} needs a scheme, e.g. http://127.0.0.1:9000"
            )

    @classmethod
    def with_environment_endpoint(cls, endpoint_url: str | None = None) -> S3Options:
        """Options whose endpoint is `endpoint_url`, else `$AWS_ENDPOINT_URL`, else AWS's.

        Raises:
            ValueError: the endpoint has no http(s) scheme.
        """
        endpoint = endpoint_url or os.environ.get(ENDPOINT_ENV, "") or None
        return cls(endpoint_url=endpoint)

    @staticmethod
    def serves(uri: str) -> bool:
        """Whether `uri` is an S3 root (`s3://`, `s3a://`), which these options describe."""
        # Imported here: the registry loads fsspec, which `import ckpt_manager` does not need.
        from ckpt_manager._store.backends import serves_s3

        return serves_s3(uri)

    def fsspec_options(self, uri: str) -> dict[str, Any]:
        """fsspec options for `uri`: these S3 settings for `s3://` URIs, nothing for others."""
        if not self.serves(uri):
            return {}
        options: dict[str, Any] = {}
        client: dict[str, Any] = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        if client:
            options["client_kwargs"] = client
        if self.profile:
            options["profile"] = self.profile
        if self.anon:
            options["anon"] = True
        return options
