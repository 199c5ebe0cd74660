"""What each rank contributes to a step, and how the coordinator commits it.

Format 2 (the save path): each rank's `SaveRequest.contribution` (built by `prepare_rank`)
holds its pending index object and the report it will send; once its writer has written the
shard file and the index (`_format/rank_index.py`), `rank_report` turns it into a
`RankReport`, the coordinator gathers those and `commit_step` builds the top manifest from
them alone (`build_top_manifest`: no HEAD, no read of any index) and writes it exclusively.
These functions need no process group: `bench/ckpt_scale.py` drives them for N simulated ranks.

Format 1 (`ckptctl reshard` only): a contribution is a plain dict::

    {"rank": r, "file": name | None, "size": int, "crc32": int,
     "checksum_algorithm": str (absent: crc32), "tree": skeleton | None,
     "metrics": {...} | None, "tensors": {key: {"dtype", "global_shape", "kind", "piece"}},
     "rank_local": {"trees": [...], "tensors": {key: {"dtype", "piece"}}}}

Only the coordinator sends the tree and metrics; only it writes replicated tensors.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import pickle
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from typing import Any, NamedTuple

import torch

from ckpt_manager._format.checksum import SAVE_ALGORITHM, parse_algorithm
from ckpt_manager._format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    Piece,
    index_file_name,
    step_dir,
)
from ckpt_manager._format.rank_index import IndexedFile, PieceRecord, RankIndex, RankReport
from ckpt_manager._format.shard_file import FileLayout, dtype_name
from ckpt_manager._format.tree import Flattened, LeafKind, TensorLeaf
from ckpt_manager._store.root_catalog import record_commit
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import (
    CheckpointError,
    CommitConflictError,
    LeaseLostError,
    ObjectExistsError,
)

__all__ = [
    "CommitOutcome",
    "CommitResult",
    "build_contribution",
    "build_top_manifest",
    "commit_manifest",
    "commit_step",
    "decode_report",
    "encode_report",
    "encode_report_body",
    "leaves_to_write",
    "merge_manifest",
    "piece_records",
    "prepare_rank",
    "rank_report",
    "versions",
]


def leaves_to_write(flat: Flattened, rank: int) -> list[TensorLeaf]:
    """The leaves this rank writes: rank-local always, replicated on rank 0, sharded unless
    the rank's piece is empty.

    An empty piece of a non-empty tensor holds nothing to read back (format 2 lists only
    non-empty pieces), so a rank whose pieces are all empty — a replica of a hybrid (HSDP)
    layout, a DTensor replica — writes no shard file at all, and a hybrid checkpoint takes
    the bytes of one replica's. A zero-element tensor keeps its (empty) pieces so the top
    manifest still names it.
    """
    return [
        leaf
        for leaf in flat.leaves
        if (leaf.kind is not LeafKind.REPLICATED or rank == 0)
        and not (
            leaf.kind is LeafKind.SHARDED
            and leaf.tensor.numel() == 0
            and math.prod(leaf.global_shape) > 0
        )
    ]


def piece_records(
    leaves: Sequence[TensorLeaf], layout: FileLayout, file_name: str | None
) -> list[PieceRecord]:
    """One record per leaf this rank writes: its piece in the rank's shard file."""
    records = []
    for leaf, slot in zip(leaves, layout.slots, strict=True):
        assert file_name is not None
        piece = Piece(
            file_name, slot.offset, slot.nbytes, slot.shape, leaf.global_offset, leaf.flat_range
        )
        records.append(
            PieceRecord(
                leaf.key,
                str(leaf.kind),
                dtype_name(leaf.tensor.dtype),
                tuple(leaf.global_shape),
                piece,
            )
        )
    return records


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
    """This rank's contribution to a format-2 save, before anything is written.

    Holds the pending index (`index_json`: its shard size and checksum still 0, filled in by
    `rank_index.write_finished_index` once the file is written) and the parts of the report
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


def build_top_manifest(
    *,
    step: int,
    run_id: str,
    created_unix_s: float,
    committed_unix_s: float,
    reports: Sequence[RankReport],
    spread_prefixes: int = 0,
) -> Manifest:
    """The coordinator's merge of every rank's report (indexed by rank) into the top manifest.

    `spread_prefixes` is what every rank wrote under (the same config on each rank); the
    manifest records it and names the indexes with their sub-prefix.

    Raises:
        ValueError: reports out of rank order, or ranks disagree on a tensor's dtype or
            global shape.
    """
    files: dict[str, FileEntry] = {}
    tensors: dict[str, dict[str, Any]] = {}
    tree: Any = None
    metrics: Mapping[str, Any] = {}
    for rank, report in enumerate(reports):
        if report.rank != rank:
            raise ValueError(f"report {rank} is rank {report.rank}'s: reports go in rank order")
        if report.file is not None:
            files[report.file.name] = FileEntry(
                report.file.size,
                report.file.crc32,
                parse_algorithm(report.file.checksum_algorithm),
            )
        files[index_file_name(rank, spread_prefixes)] = report.index_file
        if report.tree is not None:
            tree, metrics = report.tree, report.metrics or {}
        for key, (dtype, shape, kind, form, held) in report.tensors.items():
            rec = tensors.get(key)
            if rec is None:
                rec = tensors[key] = {
                    "dtype": dtype,
                    "global_shape": list(shape),
                    "kind": kind,
                    "form": form,
                    "ranks": [],
                }
            elif (rec["dtype"], rec["global_shape"]) != (dtype, list(shape)):
                raise ValueError(
                    f"tensor {key!r}: rank {rank} saved {dtype} {list(shape)}, another rank "
                    f"{rec['dtype']} {rec['global_shape']}"
                )
            if held:
                if not rec["ranks"]:
                    rec["form"] = form  # an empty piece's form says nothing
                rec["ranks"].append(rank)
    return Manifest(
        step=step,
        world_size=len(reports),
        run_id=run_id,
        created_unix_s=created_unix_s,
        committed_unix_s=committed_unix_s,
        versions=versions(),
        metrics=dict(metrics),
        files=files,
        tree=tree,
        tensors=tensors,
        rank_local=(),
        format_version=FORMAT_VERSION,
        complete=False,
        spread_prefixes=spread_prefixes,
    )


def build_contribution(
    rank: int,
    flat: Flattened,
    leaves: Sequence[TensorLeaf],
    layout: FileLayout,
    file_name: str | None,
    metrics: Mapping[str, Any],
) -> dict[str, Any]:
    """This rank's part of the manifest; `size`/`crc32` are filled once the file is written."""
    tensors: dict[str, Any] = {}
    local_tensors: dict[str, Any] = {}
    for leaf, slot in zip(leaves, layout.slots, strict=True):
        assert file_name is not None
        piece = Piece(
            file_name,
            slot.offset,
            slot.nbytes,
            slot.shape,
            leaf.global_offset,
            leaf.flat_range,
        )
        dtype = dtype_name(leaf.tensor.dtype)
        if leaf.kind is LeafKind.RANK_LOCAL:
            local_tensors[leaf.key] = {"dtype": dtype, "piece": piece}
        else:
            tensors[leaf.key] = {
                "dtype": dtype,
                "global_shape": list(leaf.global_shape),
                "kind": "sharded" if leaf.kind is LeafKind.SHARDED else "replicated",
                "piece": piece,
            }
    return {
        "rank": rank,
        "file": file_name,
        "size": 0,
        "crc32": 0,
        "tree": flat.tree if rank == 0 else None,
        "metrics": dict(metrics) if rank == 0 else None,
        "tensors": tensors,
        "rank_local": {"trees": flat.rank_local_trees, "tensors": local_tensors},
    }


def versions() -> dict[str, str]:
    """Library versions recorded in manifests (a fresh dict each call)."""
    return dict(_versions())


@functools.cache
def _versions() -> dict[str, str]:
    # Looked up once per process: reading the installed package's metadata parses its
    # METADATA file, about 1 ms of every commit otherwise.
    try:
        ours = metadata.version("trainingd")
    except metadata.PackageNotFoundError:
        ours = "0+unknown"
    return {
        "trainingd": ours,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "platform": sys.platform,
    }


def merge_manifest(
    *,
    step: int,
    run_id: str,
    created_unix_s: float,
    committed_unix_s: float,
    contributions: Sequence[Mapping[str, Any]],
) -> Manifest:
    """Merge every rank's contribution (indexed by rank) into the step's manifest.

    Raises:
        ValueError: ranks disagree on a sharded tensor's dtype or global shape.
    """
    files: dict[str, FileEntry] = {}
    tensors: dict[str, dict[str, Any]] = {}
    for c in contributions:
        if c["file"] is not None:
            files[c["file"]] = FileEntry(
                int(c["size"]), int(c["crc32"]), parse_algorithm(c.get("checksum_algorithm"))
            )
        for key, rec in c["tensors"].items():
            merged = tensors.setdefault(
                key,
                {
                    "dtype": rec["dtype"],
                    "global_shape": rec["global_shape"],
                    "kind": rec["kind"],
                    "pieces": [],
                },
            )
            if (merged["dtype"], merged["global_shape"]) != (rec["dtype"], rec["global_shape"]):
                raise ValueError(
                    f"tensor {key!r}: rank {c['rank']} saved {rec['dtype']} "
                    f"{rec['global_shape']}, another rank {merged['dtype']} "
                    f"{merged['global_shape']}"
                )
            merged["pieces"].append(rec["piece"])
    head = contributions[0]
    return Manifest(
        step=step,
        world_size=len(contributions),
        run_id=run_id,
        created_unix_s=created_unix_s,
        committed_unix_s=committed_unix_s,
        versions=versions(),
        metrics=dict(head["metrics"] or {}),
        files=files,
        tree=head["tree"],
        tensors=tensors,
        rank_local=tuple(dict(c["rank_local"]) for c in contributions),
    )


class CommitResult(enum.Enum):
    """How a commit attempt ended."""

    COMMITTED = "committed"
    """The manifest this attempt built is the step's manifest."""
    FAILED = "failed"
    """Nothing was committed by this attempt; its folder may be removed."""
    CONFLICT = "conflict"
    """Another attempt's manifest holds the step: the folder is that commit's, kept."""
    FENCED = "fenced"
    """This run lost the root's lease: nothing written, nothing removed (the root is not
    ours any more)."""


class CommitOutcome(NamedTuple):
    """The coordinator's commit outcome, broadcast to every rank."""

    result: CommitResult
    committed_unix_s: float = 0.0
    """Commit time written in the manifest (COMMITTED only)."""
    cause: str = ""
    """Why the step is not committed by this attempt (FAILED and CONFLICT)."""
    conflict: CheckpointError | None = None
    """The error every rank chains its `SaveFailedError` to: `CommitConflictError`
    (CONFLICT) or `LeaseLostError` (FENCED)."""


def commit_manifest(
    storage: Storage,
    *,
    step: int,
    run_id: str,
    created_unix_s: float,
    contributions: Sequence[Mapping[str, Any]],
    fence: Callable[[], None] | None = None,
) -> CommitOutcome:
    """Coordinator: check every shard's size, then write the manifest exclusively.

    `fence` (the lease's `confirm`) runs first and again right before the manifest write:
    a run that lost the root's lease commits nothing and removes nothing (FENCED; see
    [Note: fencing] in `_store/lease.py`).

    [Note: an existing manifest is read back] The exclusive write can find the manifest
    already there (`ObjectExistsError`: local `os.link`, or S3 answering 412 to the
    conditional PUT). Either our own write landed before (S3 retried a PUT whose reply was
    lost) or another attempt committed the step (a second launch of the job on this root).
    The existing manifest is read back and compared with the exact bytes this attempt wrote
    (not a freshly built manifest: `committed_unix_s` would differ): the same manifest is a
    commit; anything else is a CONFLICT, and the folder, being that other commit's, is kept.

    Returns:
        The outcome; never raises for storage problems, so it can be broadcast to every rank.
    """
    folder = step_dir(step)
    try:
        if fence is not None:
            fence()
        for c in contributions:
            if c["file"] is None:
                continue
            size = storage.size(f"{folder}/{c['file']}")
            if size != c["size"]:
                why = f"{c['file']} has {size} bytes, rank {c['rank']} wrote {c['size']}"
                # A shard replaced under us: most likely by another attempt's commit.
                if storage.exists(f"{folder}/{MANIFEST_NAME}"):
                    return _resolve_existing(storage, step, ours=None)
                return CommitOutcome(CommitResult.FAILED, cause=why)
        committed = time.time()
        manifest = merge_manifest(
            step=step,
            run_id=run_id,
            created_unix_s=created_unix_s,
            committed_unix_s=committed,
            contributions=contributions,
        )
        return _publish(storage, manifest, committed, fence)
    except LeaseLostError as err:
        return CommitOutcome(CommitResult.FENCED, cause=f"LeaseLostError: {err}", conflict=err)
    except (CheckpointError, ValueError) as err:
        return CommitOutcome(CommitResult.FAILED, cause=f"{type(err).__name__}: {err}")


def _publish(
    storage: Storage, manifest: Manifest, committed: float, fence: Callable[[], None] | None
) -> CommitOutcome:
    """The commit's last act, both formats: fence, write the manifest exclusively, index it.

    Raises what the fence and the write raise (the callers turn it into an outcome).
    """
    data = manifest.to_json()
    if fence is not None:
        fence()
    try:
        storage.write(f"{step_dir(manifest.step)}/{MANIFEST_NAME}", data, exclusive=True)
    except ObjectExistsError:
        return _resolve_existing(storage, manifest.step, ours=(bytes(data), committed))
    # [Note: the manifest was just PUT] The step is committed from here on: the one place a
    # save becomes durable (what follows it, e.g. an index of the root, may fail without
    # un-committing the step).
    record_commit(storage, manifest, manifest_bytes=len(data))  # the root catalog (an index)
    return CommitOutcome(CommitResult.COMMITTED, committed_unix_s=committed)


def commit_step(
    storage: Storage,
    *,
    step: int,
    run_id: str,
    created_unix_s: float,
    reports: Sequence[RankReport],
    fence: Callable[[], None] | None = None,
    spread_prefixes: int = 0,
) -> CommitOutcome:
    """Coordinator: build the format-2 top manifest from the reports, write it exclusively.

    Sizes and checksums come from the writers' reports: no HEAD of any file (at 1024 ranks
    the sequential HEADs of format 1 were most of the commit). A shard replaced under us by
    another attempt cannot pass unnoticed anyway: that attempt's commit holds the manifest,
    which the exclusive write finds ([Note: an existing manifest is read back]), and
    restore checks every index against the manifest's size and CRC-32. `fence` (the lease's
    `confirm`) runs before the build and right before the write ([Note: fencing] in
    `_store/lease.py`).

    Returns:
        The outcome; never raises for storage problems, so it can be broadcast to every rank.
    """
    try:
        if fence is not None:
            fence()
        committed = time.time()
        manifest = build_top_manifest(
            step=step,
            run_id=run_id,
            created_unix_s=created_unix_s,
            committed_unix_s=committed,
            reports=reports,
            spread_prefixes=spread_prefixes,
        )
        return _publish(storage, manifest, committed, fence)
    except LeaseLostError as err:
        return CommitOutcome(CommitResult.FENCED, cause=f"LeaseLostError: {err}", conflict=err)
    except (CheckpointError, ValueError) as err:
        return CommitOutcome(CommitResult.FAILED, cause=f"{type(err).__name__}: {err}")


def _resolve_existing(
    storage: Storage, step: int, *, ours: tuple[bytes, float] | None
) -> CommitOutcome:
    """See [Note: an existing manifest is read back]; `ours`: the bytes we wrote, their time."""
    try:
        theirs = storage.read(f"{step_dir(step)}/{MANIFEST_NAME}")
    except CheckpointError as err:
        # It exists but cannot be read: we cannot tell whose it is. Not committed by us as
        # far as we know; the folder is kept anyway (it holds a manifest).
        return CommitOutcome(
            CommitResult.FAILED,
            cause=f"the manifest already exists and could not be read back: {err}",
        )
    doc = _json_or_none(theirs)
    if ours is not None and (
        theirs == ours[0] or (doc is not None and doc == _json_or_none(ours[0]))
    ):
        return CommitOutcome(CommitResult.COMMITTED, committed_unix_s=ours[1])
    other = doc.get("run_id") if isinstance(doc, dict) else None
    conflict = CommitConflictError(step, other if isinstance(other, str) else None)
    return CommitOutcome(
        CommitResult.CONFLICT,
        cause=f"{type(conflict).__name__}: {conflict}",
        conflict=conflict,
    )


def _json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
