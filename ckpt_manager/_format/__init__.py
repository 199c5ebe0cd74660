"""What the bytes of a checkpoint mean: names, schemas and encodings, with no I/O.

It imports none of its sibling sub-packages: `_store` (where bytes go), the save and load
paths and the CLI build on it. Only `shard_file.py`, `tree.py` and `dtensor.py` need torch;
the rest stays torch-free so `ckptctl list/show/verify` start fast.

    names.py        validate_relative_name: every name from a manifest or listing is checked
                    here before it touches storage (no `..`, no absolute paths).
    layout.py       where objects sit under a root: step-<N:012d>, rank-<r:05d>.bin,
                    rank-<r:05d>.index.json, manifest.json, _pins/; spread_prefix for
                    request spreading on S3; check_step_file_name.
    pieces.py       FileEntry and Piece (a step's file records and the tensor pieces in
                    them) with the extent and place checks every reader relies on.
    manifest.py     Manifest, the model every reader uses; format 2's small top manifest
                    (the only format written): serialisation, its own checksum, validation;
                    parsing dispatches format 1 to legacy_v1. EncodedTensors: tensor
                    records encoded once, reused by successive commits.
    legacy_v1.py    the format-1 reader (every piece inline, written before issue #18): read
                    into a complete Manifest, never written.
    rank_index.py   per-rank index objects (format 2): build, parse and check against the top
                    manifest; RankReport (what a rank tells the coordinator); assemble (a
                    summary merged with its indexes).
    checksum.py     file checksums by algorithm (ChecksumAlgorithm): CRC-32 through ISA-L
                    (zlib fallback; older manifests), CRC-32C (new saves) through ISA-L
                    `crc32_iscsi` (`crc32c` package fallback).
    shard_file.py   shard file format: magic + JSON header + aligned raw tensor bytes.
    dtypes.py       dtype names and item sizes without torch (manifest validation).
    tree.py         state <-> JSON skeleton + tensor leaves (replicated, sharded, rank-local).
    dtensor.py      DTensor leaves as box pieces (replicas write once); restore templates
                    with DTensors wrapped and unwrapped around the load.
"""
