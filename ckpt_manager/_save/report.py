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
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ckpt_manager._format.checksum import SAVE_ALGORITHM, parse_algorithm
from ckpt_manager._format.pieces import FileEntry
from ckpt_manager._format.rank_index import IndexedFile, PieceRecord, RankIndex, RankReport
from ckpt_manager._format.tree import Flattened
from ckpt_manager.errors import CheckpointError

__all__ = [
    "ReportCache",
    "decode_report",
    "encode_report",
    "encode_report_body",
    "prepare_rank",
    "rank_report",
    "report_tensor_list",
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


# [Note: the report skeleton is reused while the layout is unchanged] Between two saves of a
# run only the step, the metrics and the written files' sizes and checksums change; the rank's
# pending index (every piece's place) and its report's tensor list are the same.
# Building them (`RankIndex.build`, its JSON, `RankReport.of`) and pickling the tensor list
# cost about 1.5 ms of staging-thread CPU per save on the bench's 156-tensor state,
# part of the fixed per-save work #33 measures. `ReportCache` keeps them while the inputs are
# the same: the piece records *object* (`PlanCache` hands back the same tuple exactly while
# keys, dtypes, shapes, placements and the file name are unchanged, and plans afresh on any
# change), the rank, the file name, the spread and the rank-local trees (compared by value:
# they are part of the index). The tree itself is not part of the skeleton (it holds the
# state's plain values, e.g. a step counter, so it changes at every save); it only decides
# whether empty tensors are listed, which the rank (0 sends the tree) already fixes. The step
# is spliced into the cached index JSON, byte for byte what `to_json` writes. The cached
# objects are never mutated (the contribution's other fields are replaced whole), so saves in
# flight may share them.
_STEP_SLOT = b'"step":0,'


class _Skeleton(NamedTuple):
    """A contribution's layout-dependent parts."""

    records: Sequence[PieceRecord]
    rank: int
    file_name: str | None
    spread_prefixes: int
    rank_local_trees: Sequence[Any]
    index_head: bytes  # the pending index's JSON up to its step field
    index_tail: bytes  # and after it
    tensors: dict[str, Any]


class ReportCache:
    """`prepare_rank` with the last contribution's skeleton reused (one per manager).

    See [Note: the report skeleton is reused while the layout is unchanged].
    """

    def __init__(self) -> None:
        """Start empty: the first save builds."""
        self._last: _Skeleton | None = None
        self.num_built = 0
        """How many times a skeleton was built (not reused)."""

    def prepare(
        self,
        *,
        step: int,
        rank: int,
        flat: Flattened,
        records: Sequence[PieceRecord],
        file_name: str | None,
        metrics: Mapping[str, Any],
        spread_prefixes: int = 0,
    ) -> dict[str, Any]:
        """What `prepare_rank` returns for these arguments (equal fields, equal index JSON).

        Raises:
            ValueError: as `prepare_rank`.
        """
        tree = flat.tree if rank == 0 else None
        last = self._last
        if not (
            last is not None
            and last.records is records
            and (last.rank, last.file_name, last.spread_prefixes)
            == (rank, file_name, spread_prefixes)
            and last.rank_local_trees == list(flat.rank_local_trees)
        ):
            built = prepare_rank(
                step=0,
                rank=rank,
                flat=flat,
                records=records,
                file_name=file_name,
                metrics={},
                spread_prefixes=spread_prefixes,
            )
            head, slot, tail = built["index_json"].encode().partition(_STEP_SLOT)
            if not slot:
                raise ValueError("the pending index's JSON has no step field to fill in")
            last = self._last = _Skeleton(
                records=records,
                rank=rank,
                file_name=file_name,
                spread_prefixes=spread_prefixes,
                rank_local_trees=list(flat.rank_local_trees),
                index_head=head,
                index_tail=tail,
                tensors=built["tensors"],
            )
            self.num_built += 1
        index_json = last.index_head + b'"step":%d,' % step + last.index_tail
        return {
            "rank": rank,
            "file": file_name,
            "size": 0,
            "crc32": 0,
            "index_size": 0,
            "index_crc32": 0,
            "index_json": index_json.decode(),
            "spread_prefixes": spread_prefixes,
            "tensors": last.tensors,
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


class _LastPickle:
    """The last tensor list `encode_report_body` pickled, with its bytes (process-wide)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[Any, bytes] | None = None

    def of(self, tensors: Any) -> bytes:
        """`tensors` pickled; the same bytes again while it is the same object."""
        with self._lock:
            last = self._last
        if last is not None and last[0] is tensors:
            return last[1]
        # Pickled like gather_object would: our own NamedTuples and plain data, between our
        # ranks.
        data = pickle.dumps(tensors, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._last = (tensors, data)
        return data


_TENSOR_LISTS = _LastPickle()


def encode_report_body(contribution: Mapping[str, Any]) -> bytes:
    """The bulk of a rank's report: its tensor list, then its tree and metrics, pickled.

    The tensor list is pickled once while `ReportCache` hands out the same object ([Note:
    the report skeleton is reused while the layout is unchanged]).
    """
    listed = _TENSOR_LISTS.of(contribution["tensors"])
    rest = (contribution["tree"], contribution["metrics"])
    return (
        len(listed).to_bytes(_HEAD_LENGTH_BYTES, "little")
        + listed
        + pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL)
    )


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


def report_tensor_list(payload: bytes) -> bytes:
    """The pickled tensor list inside a framed report (what `encode_report_body` reuses
    while the layout is unchanged: equal bytes, equal list)."""
    n = int.from_bytes(payload[:_HEAD_LENGTH_BYTES], "little")
    body = payload[_HEAD_LENGTH_BYTES + n :]
    m = int.from_bytes(body[:_HEAD_LENGTH_BYTES], "little")
    return body[_HEAD_LENGTH_BYTES : _HEAD_LENGTH_BYTES + m]


def decode_report(payload: bytes, *, tensors: bool = True) -> RankReport:
    """The `RankReport` that `encode_report` framed (on the coordinator); without
    `tensors`, its tensor list is left empty (not unpickled)."""
    n = int.from_bytes(payload[:_HEAD_LENGTH_BYTES], "little")
    head = pickle.loads(payload[_HEAD_LENGTH_BYTES : _HEAD_LENGTH_BYTES + n])
    body = payload[_HEAD_LENGTH_BYTES + n :]
    m = int.from_bytes(body[:_HEAD_LENGTH_BYTES], "little")
    listed = pickle.loads(body[_HEAD_LENGTH_BYTES : _HEAD_LENGTH_BYTES + m]) if tensors else {}
    tree, metrics = pickle.loads(body[_HEAD_LENGTH_BYTES + m :])
    if not isinstance(head, RankReport):
        raise CheckpointError(f"a rank's report decoded to {type(head).__name__}")
    return head._replace(tensors=listed, tree=tree, metrics=metrics)
