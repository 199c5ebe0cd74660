"""The coordinator's commit of a save: the top manifest from the ranks' reports, published.

Every rank's writer reports its shard file and index (`_save/report.py`); the coordinator
gathers the reports and `commit_step` (on the finalizer's thread) builds the format-2 top
manifest from them alone (`build_top_manifest`: no HEAD, no read of any index), then
publishes it through the one commit path, `_store/publish.publish_manifest` (lease fence,
exclusive manifest write, root catalog record), which `ckptctl reshard` uses too.
"""

from __future__ import annotations

import functools
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from typing import Any

import torch

from ckpt_manager._format.checksum import parse_algorithm
from ckpt_manager._format.layout import index_file_name
from ckpt_manager._format.manifest import FORMAT_VERSION, EncodedTensors, Manifest
from ckpt_manager._format.pieces import FileEntry
from ckpt_manager._format.rank_index import RankReport
from ckpt_manager._store.publish import CommitOutcome, failed_outcome, publish_manifest
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError

__all__ = ["TopTensors", "build_top_manifest", "commit_step", "merge_tensors", "versions"]


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


def merge_tensors(reports: Sequence[RankReport]) -> dict[str, dict[str, Any]]:
    """The top manifest's tensor records from every rank's report (in rank order): dtype,
    global shape, kind, form and the ranks holding non-empty pieces.

    Raises:
        ValueError: ranks disagree on a tensor's dtype or global shape.
    """
    tensors: dict[str, dict[str, Any]] = {}
    for rank, report in enumerate(reports):
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
    return tensors


# [Note: the top manifest's tensor records are reused] Every commit of a run merges the
# ranks' tensor lists into the top manifest's records (`merge_tensors`), encodes them as
# JSON, and unpickled the lists first: about 1.5-2 ms of the coordinator's CPU per save on
# the bench's 156-tensor state, each time the same result while the layout is unchanged. Each
# rank sends its tensor list as the same pickled bytes while its layout is unchanged ([Note:
# the report skeleton is reused while the layout is unchanged] in `report.py`), so equal
# bytes from every rank mean equal lists: `TopTensors` keeps the last merge (read-only,
# `EncodedTensors`, JSON encoded once) keyed by those bytes and by the spread, and the commit
# skips unpickling, merging and encoding. Any other bytes (a reshape, a reshard, another world
# size) merge afresh.


class TopTensors:
    """The last commit's merged tensor records, keyed by every rank's pickled tensor list
    (one per finalizer; used from its commit thread only)."""

    def __init__(self) -> None:
        """Start empty: the first commit merges."""
        self._key: tuple[bytes, ...] | None = None
        self._tensors: EncodedTensors | None = None
        self.num_merged = 0
        """How many times the records were merged (not reused)."""

    def cached(self, lists: Sequence[bytes]) -> EncodedTensors | None:
        """The records merged from these tensor lists last time, if it was these."""
        return self._tensors if self._key == tuple(lists) else None

    def merge(self, lists: Sequence[bytes], reports: Sequence[RankReport]) -> EncodedTensors:
        """Merge `reports` (decoded with their tensor lists `lists`) and keep the result.

        Raises:
            ValueError: as `merge_tensors`.
        """
        merged = EncodedTensors(merge_tensors(reports))
        self._key, self._tensors = tuple(lists), merged
        self.num_merged += 1
        return merged


def build_top_manifest(
    *,
    step: int,
    run_id: str,
    created_unix_s: float,
    committed_unix_s: float,
    reports: Sequence[RankReport],
    spread_prefixes: int = 0,
    tensors: Mapping[str, Mapping[str, Any]] | None = None,
) -> Manifest:
    """The coordinator's merge of every rank's report (indexed by rank) into the top manifest.

    `spread_prefixes` is what every rank wrote under (the same config on each rank); the
    manifest records it and names the indexes with their sub-prefix. `tensors`, when given,
    are the records `merge_tensors` gives for these reports (merged before: [Note: the top
    manifest's tensor records are reused]); the reports' own tensor lists are then not read.

    Raises:
        ValueError: reports out of rank order, or ranks disagree on a tensor's dtype or
            global shape.
    """
    files: dict[str, FileEntry] = {}
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
        tensors=merge_tensors(reports) if tensors is None else tensors,
        rank_local=(),
        format_version=FORMAT_VERSION,
        complete=False,
        spread_prefixes=spread_prefixes,
    )


def commit_step(
    storage: Storage,
    *,
    step: int,
    run_id: str,
    created_unix_s: float,
    reports: Sequence[RankReport],
    fence: Callable[[], None] | None = None,
    spread_prefixes: int = 0,
    tensors: Mapping[str, Mapping[str, Any]] | None = None,
    before_publish: Callable[[Manifest], None] | None = None,
) -> CommitOutcome:
    """Coordinator: build the top manifest from the reports and publish it.

    Sizes and checksums come from the writers' reports: no HEAD of any file (at 1024 ranks
    the sequential HEADs of format 1's commit were most of it). A shard replaced under us by
    another attempt cannot pass unnoticed anyway: that attempt's commit holds the manifest,
    which the exclusive write finds ([Note: an existing manifest is read back] in
    `_store/publish.py`), and restore checks every index against the manifest's size and
    CRC-32. `fence` (the lease's `confirm`) runs before the build and again right before the
    write ([Note: fencing] in `_store/lease.py`). `tensors`: as in `build_top_manifest`.
    `before_publish` is called with the manifest once it is built, before anyone can list it
    (retention learns the commit from it: [Note: retention learns a commit from the
    finalizer] in `_retention/deleter.py`).

    Returns:
        The outcome; never raises for storage problems, so it can be broadcast to every rank.
    """
    try:
        if fence is not None:
            fence()
        manifest = build_top_manifest(
            step=step,
            run_id=run_id,
            created_unix_s=created_unix_s,
            committed_unix_s=time.time(),
            reports=reports,
            spread_prefixes=spread_prefixes,
            tensors=tensors,
        )
    except (CheckpointError, ValueError) as err:
        return failed_outcome(err)
    if before_publish is not None:
        before_publish(manifest)
    return publish_manifest(storage, manifest, fence=fence)
