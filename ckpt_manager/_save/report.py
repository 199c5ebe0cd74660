"""What a rank tells the coordinator about its part of a save: contribution and report.

`prepare_rank` builds a rank's contribution before anything is written (on the staging
thread, see `SaveRequest.build_pending_index`): the rank's pending index object (its shard
file's size and checksum still 0) and the parts of its report known at `save()`. Once the
writer has written the shard file and the index (`_store/indexes.write_finished_index`),
`SaveRequest.finish_ok` records their sizes and checksums in it, and `rank_report` turns it
into the `RankReport` the coordinator gathers (framed by `encode_report`, unframed by
`decode_report`). The coordinator's commit builds the top manifest from the reports alone
(`_save/commit.py`).

A contribution is a plain dict (it crosses to the writer process in the write message)::

    {"rank": r, "file": name | None, "size": int, "crc32": int,
     ["checksum_algorithm": str (absent: crc32),] "index_size": int, "index_crc32": int,
     "index_json": str, "spread_prefixes": int,
     "tensors": {key: (dtype, global shape, kind, form, held)},
     "tree": skeleton | None, "metrics": {...} | None}

Only rank 0 sends the tree and metrics; only it writes replicated tensors. None of this needs
a process group: `bench/ckpt_scale.py` and `ckptctl reshard` drive it for N ranks in one
process (`written_report`).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_manager._format.checksum import SAVE_ALGORITHM, parse_algorithm
from ckpt_manager._format.pieces import FileEntry
from ckpt_manager._format.rank_index import IndexedFile, PieceRecord, RankIndex, RankReport
from ckpt_manager._format.tree import Flattened
from ckpt_manager.errors import CheckpointError

__all__ = [
    "decode_report",
    "encode_report",
    "encode_report_body",
    "prepare_rank",
    "rank_report",
    "written_report",
]


def prepare_rank(
    *,
    step: int,
    rank: int,
    flat: Flattened,
    records: Sequence[PieceRecord],
    file_name: str | None,
    metrics: Mapping[str, Any],
    spread_prefixes: int = 0,
) -> dict[str, Any]:
    """This rank's contribution to a save, before anything is written.

    Holds the pending index (`index_json`: its shard size and checksum still 0, filled in by
    `indexes.write_finished_index` once the file is written) and the parts of the report
    known now; `size`/`crc32` and `index_size`/`index_crc32` are recorded by
    `SaveRequest.finish_ok`. Rank 0 sends the tree and metrics. `spread_prefixes` places the
    index in the rank's sub-prefix (`file_name` carries it already).
    """
    pending = RankIndex.build(
        step=step,
        rank=rank,
        file=None
        if file_name is None
        else IndexedFile(name=file_name, size=0, crc32=0, checksum_algorithm=SAVE_ALGORITHM.value),
        records=records,
        rank_local_trees=flat.rank_local_trees,
    )
    tree = flat.tree if rank == 0 else None
    draft = RankReport.of(pending, FileEntry(0, 0), records, tree=tree)
    return {
        "rank": rank,
        "file": file_name,
        "size": 0,
        "crc32": 0,
        "index_size": 0,
        "index_crc32": 0,
        "index_json": pending.to_json().decode(),
        "spread_prefixes": spread_prefixes,
        "tensors": draft.tensors,
        "tree": tree,
        "metrics": dict(metrics) if rank == 0 else None,
    }


def rank_report(contribution: Mapping[str, Any]) -> RankReport:
    """The report a rank sends the coordinator once its files are written."""
    name = contribution["file"]
    return RankReport(
        rank=int(contribution["rank"]),
        index_file=FileEntry(int(contribution["index_size"]), int(contribution["index_crc32"])),
        file=None
        if name is None
        else IndexedFile(
            name=name,
            size=int(contribution["size"]),
            crc32=int(contribution["crc32"]),
            checksum_algorithm=parse_algorithm(contribution.get("checksum_algorithm")).value,
        ),
        tensors=contribution["tensors"],
        tree=contribution["tree"],
        metrics=contribution["metrics"],
    )


def written_report(
    contribution: Mapping[str, Any], *, size: int, checksum: int, index: FileEntry
) -> RankReport:
    """The report of a rank whose files a caller wrote outside the save pipeline (`ckptctl
    reshard`, tests, benches), as `SaveRequest.finish_ok` records them: its shard file's
    `size` and `checksum` by `checksum.SAVE_ALGORITHM` (what its pending index names; 0 and
    0 without a file) and its index's entry (`indexes.write_finished_index`)."""
    return rank_report(
        {
            **contribution,
            "size": size,
            "crc32": checksum,
            "checksum_algorithm": SAVE_ALGORITHM.value,
            "index_size": index.size,
            "index_crc32": index.crc32,
        }
    )


# [Note: the report is encoded before the files are durable] A rank's report is tens of
# bytes of fields known once its files are durable (sizes, checksums, the index object's
# entry) and a bulk known at `save()` (the tensor list, the tree, the metrics: milliseconds
# to pickle at thousands of tensors). The staging job pickles the bulk right after the
# copy (`encode_report_body`), before the request can reach OK; the finalizer then frames
# the whole report inline in the poll that first sees OK (`encode_report`, microseconds), so
# the agreement round that says OK is the first one issued after the write. (It used to
# hand the whole pickling to a thread and say WRITING until that was done: one poll round,
# i.e. one training step between two `maybe_finalize()` calls, more per save.)
_HEAD_LENGTH_BYTES = 4


def encode_report_body(contribution: Mapping[str, Any]) -> bytes:
    """The bulk of a rank's report: its tensor list, tree and metrics, pickled."""
    bulk = (contribution["tensors"], contribution["tree"], contribution["metrics"])
    # Pickled like gather_object would: our own NamedTuples and plain data, between our ranks.
    return pickle.dumps(bulk, protocol=pickle.HIGHEST_PROTOCOL)


def encode_report(contribution: Mapping[str, Any], body: bytes | None) -> bytes:
    """The wire form of the report a rank sends once its files are durable: the small
    fields (from `contribution`) framed in front of the pre-pickled `body`.

    Raises:
        ValueError: `body` is missing (the staging job did not encode it).
        KeyError: the contribution lacks a field of the report.
    """
    if body is None:
        raise ValueError("the report's body was not encoded by the staging job")
    head = rank_report({**contribution, "tensors": {}, "tree": None, "metrics": None})
    framed = pickle.dumps(head, protocol=pickle.HIGHEST_PROTOCOL)
    return len(framed).to_bytes(_HEAD_LENGTH_BYTES, "little") + framed + body


def decode_report(payload: bytes) -> RankReport:
    """The `RankReport` that `encode_report` framed (on the coordinator)."""
    n = int.from_bytes(payload[:_HEAD_LENGTH_BYTES], "little")
    head = pickle.loads(payload[_HEAD_LENGTH_BYTES : _HEAD_LENGTH_BYTES + n])
    tensors, tree, metrics = pickle.loads(payload[_HEAD_LENGTH_BYTES + n :])
    if not isinstance(head, RankReport):
        raise CheckpointError(f"a rank's report decoded to {type(head).__name__}")
    return head._replace(tensors=tensors, tree=tree, metrics=metrics)
