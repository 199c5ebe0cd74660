"""Format-1 manifest bytes for the reader's tests, as the format-1 writer wrote them.

The package reads format 1 and never writes it (`_format/legacy_v1.py`). The reader's
tests need varied and damaged format-1 manifests beyond the committed fixture, so this
serialises a complete `Manifest` the way the writer did until issue 28: compact JSON in this
key order, the manifest's own checksum last ([Note: the manifest's own checksum]).
"""

from __future__ import annotations

import json

from ckpt_manager._format.checksum import crc32
from ckpt_manager._format.legacy_v1 import FORMAT_VERSION_PIECES
from ckpt_manager._format.manifest import CHECKSUM_FIELD, FORMAT_NAME, SPREAD_FIELD, Manifest


def v1_manifest_bytes(m: Manifest) -> bytes:
    """`m` (complete: pieces and rank-local state) as a format-1 manifest."""
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION_PIECES,
        "step": m.step,
        "world_size": m.world_size,
        **({SPREAD_FIELD: m.spread_prefixes} if m.spread_prefixes else {}),
        "run_id": m.run_id,
        "created_unix_s": m.created_unix_s,
        "committed_unix_s": m.committed_unix_s,
        "versions": dict(m.versions),
        "metrics": dict(m.metrics),
        "files": {n: f.to_json() for n, f in m.files.items()},
        "tree": m.tree,
        "tensors": {
            k: {**v, "pieces": [p.to_json() for p in v["pieces"]]} for k, v in m.tensors.items()
        },
        "rank_local": [
            {
                "trees": rl["trees"],
                "tensors": {
                    k: {"dtype": v["dtype"], "piece": v["piece"].to_json()}
                    for k, v in rl["tensors"].items()
                },
            }
            for rl in m.rank_local
        ],
    }
    body = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
    return body[:-1] + b',"%s":%d}' % (CHECKSUM_FIELD.encode(), crc32(body))
