"""`ckptctl restore`: verify a step, then consolidate it (torch / safetensors / DCP) or reshard it.

Resharding (`--world-size N`, `ctl/reshard.py`) writes a committed step under another
checkpoint root, holding that root's lease while it writes: it is refused while a live run
holds the destination.

Consolidated outputs: one torch or safetensors file (`ctl/export.py`), Hugging Face sharded
safetensors with their index (`--max-shard-size`, `ctl/export_sharded.py`) or a torch DCP
directory (`--format dcp`, `ctl/export_dcp.py`); the last two are local directories.

The step's files are verified first (sizes and checksums, like the manager's restore), so a
damaged checkpoint fails before anything is written. Output goes to local disk or S3 in
either direction (`ctl/sink.py`), with bounded memory (`ctl/stream.py`) and a progress bar
on a TTY.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
import sys
from collections.abc import Iterator

from ckpt_manager._format.manifest import Manifest
from ckpt_manager._store.backends import local_path
from ckpt_manager._store.steps import verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.common import StorageFlags, open_root, resolve_step
from ckpt_manager.ctl.errors import UsageError
from ckpt_manager.ctl.export import (
    Selection,
    export_safetensors,
    export_torch,
    select,
    selected_bytes,
)
from ckpt_manager.ctl.export_dcp import export_dcp
from ckpt_manager.ctl.export_sharded import INDEX_NAME, export_sharded_safetensors, parse_size
from ckpt_manager.ctl.model_files import recorded_model_files, write_local_model_files
from ckpt_manager.ctl.render import Progress, format_bytes
from ckpt_manager.ctl.reshard import plan_reshard, write_resharded
from ckpt_manager.ctl.sink import OutputFile, split_uri

__all__ = ["OutputFormat", "RestoreRequest", "run_restore"]

_MIB = 1 << 20


class OutputFormat(enum.StrEnum):
    """What `restore` produces."""

    TORCH = "torch"
    """One `torch.save` file of the full (consolidated) state."""
    SAFETENSORS = "safetensors"
    """One safetensors file of the full tensors."""
    CHECKPOINT = "checkpoint"
    """A checkpoint root with the step resharded into `world_size` rank files."""
    DCP = "dcp"
    """A torch DCP checkpoint directory (`FileSystemWriter` layout)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class RestoreRequest:
    """One `ckptctl restore` invocation."""

    uri: str
    """Source checkpoint root."""
    step: str | int | None = None
    """Step number, `latest` or None (latest)."""
    to: str
    """Output file, or checkpoint root for `--world-size`."""
    format: str | None = None
    """`torch`, `safetensors`, `dcp` or None (torch, or checkpoint with `world_size`)."""
    max_shard_size: str | None = None
    """With `safetensors`: write Hugging Face sharded files of at most this size (`2GB`)
    plus their index into the directory `to`, instead of one file."""
    world_size: int | None = None
    """Reshard for this many ranks."""
    only: tuple[str, ...] = ()
    """Top-level entries to keep (consolidated formats only)."""
    overwrite: bool = False
    """Replace an existing output file."""
    chunk_bytes: int = 64 * _MIB
    """Read chunk: memory stays within a few of these."""
    verify_checksums: bool = True
    """Re-read every file and check its crc32 before restoring (sizes are always checked)."""

    def __post_init__(self) -> None:
        if self.world_size is not None:
            if self.world_size < 1:
                raise UsageError(f"--world-size {self.world_size}: use 1 or more")
            if self.format is not None:
                raise UsageError("--world-size writes rank files; drop --format")
            if self.only:
                raise UsageError("--only applies to --format torch|safetensors, not --world-size")
        if self.max_shard_size is not None:
            if self.format != OutputFormat.SAFETENSORS:
                raise UsageError("--max-shard-size applies to --format safetensors only")
            parse_size(self.max_shard_size)
        local_dir = self.format == OutputFormat.DCP or self.max_shard_size is not None
        if local_dir and local_path(self.to) is None:
            raise UsageError(
                f"--to {self.to}: this format writes a directory on local disk; write it "
                "locally and copy it"
            )
        if self.chunk_bytes < _MIB:
            raise UsageError("--buffer-mib must be at least 1")
        if not self.to:
            raise UsageError("--to needs a path or s3:// URI")

    @property
    def output_format(self) -> OutputFormat:
        """The resolved output kind."""
        if self.world_size is not None:
            return OutputFormat.CHECKPOINT
        return OutputFormat(self.format or OutputFormat.TORCH)


def run_restore(req: RestoreRequest, flags: StorageFlags) -> Iterator[str]:
    """Do the restore; yields summary lines for stdout.

    Raises:
        UsageError: bad selection or destination.
        StepNotFoundError: no such committed step (nearest steps named).
        CorruptCheckpointError: the step fails verification.
        StorageError: reading or writing failed.
    """
    source = open_root(req.uri, flags)
    step, manifest = resolve_step(source, req.step)
    # Same check as the manager's restore; a damaged step fails before anything is written.
    verify_files(source, manifest, sorted(manifest.files), check_crc=req.verify_checksums)
    kind = req.output_format
    if kind is OutputFormat.CHECKPOINT:
        assert req.world_size is not None
        dest = open_root(req.to, flags, must_exist=False)
        if dest.same_root_as(source):
            raise UsageError("--to is the source root: write the resharded step elsewhere")
        plan = plan_reshard(manifest, req.world_size)
        progress = Progress(plan.num_bytes, req.world_size)
        try:
            write_resharded(
                source,
                manifest,
                dest,
                plan,
                chunk_bytes=req.chunk_bytes,
                progress=progress,
                on_lease_wait=lambda line: print(f"ckptctl restore: note: {line}", file=sys.stderr),
            )
        finally:
            progress.close()
        if plan.dropped_ranks:
            print(
                f"ckptctl restore: note: rank-local state of {plan.dropped_ranks} saved ranks "
                f"beyond the new world size {req.world_size} was dropped",
                file=sys.stderr,
            )
        yield (
            f"step {step}: resharded {manifest.world_size} -> {req.world_size} ranks "
            f"({format_bytes(plan.num_bytes)}) under {req.to}"
        )
        return
    sel = select(manifest, req.only)
    for path in sel.skipped:
        print(
            f"ckptctl restore: note: left out rank-local state {path!r} (per-rank RNG / "
            "data positions do not belong in a consolidated state dict)",
            file=sys.stderr,
        )
    total = selected_bytes(manifest, sel)
    files = recorded_model_files(manifest) if kind is OutputFormat.SAFETENSORS else {}
    if kind is OutputFormat.SAFETENSORS:
        _note_model_files(req, files)
    if kind is OutputFormat.DCP or req.max_shard_size is not None:
        yield _export_directory(req, source, manifest, sel, total)
        if files:
            directory = local_path(req.to)
            assert directory is not None  # RestoreRequest refused other destinations
            write_local_model_files(files, directory)
            yield f"step {step}: wrote {', '.join(files)} to {directory}"
        return
    parent = split_uri(req.to)[0]
    beside = {} if split_uri(req.to)[1] != _SINGLE_NAME else files
    # Constructed first: an existing config.json without --force fails before the weights.
    extra = [
        (OutputFile(f"{parent}/{n}", flags, overwrite=req.overwrite), t) for n, t in beside.items()
    ]
    output = OutputFile(req.to, flags, overwrite=req.overwrite)
    progress = Progress(total, 1)
    try:
        with output.writing() as local:
            writer = export_torch if kind is OutputFormat.TORCH else export_safetensors
            count = writer(
                source, manifest, sel, local, chunk_bytes=req.chunk_bytes, progress=progress
            )
        progress.advance(num_files=1)
    finally:
        progress.close()
    yield (
        f"step {step}: wrote {count} tensors ({format_bytes(total)}) as {kind.value} to {req.to}"
    )
    for extra_file, text in extra:
        with extra_file.writing() as local, open(local, "w", encoding="utf-8") as out:
            out.write(text)
        yield f"step {step}: wrote {extra_file.name} beside it"


_SINGLE_NAME = "model.safetensors"  # the single-file name `from_pretrained(folder)` reads


def _note_model_files(req: RestoreRequest, files: dict[str, str]) -> None:
    """One stderr line when a safetensors export will have no `config.json` beside it."""
    if "config.json" not in files:
        print(
            "ckptctl restore: note: the step records no config.json (the run did not start "
            "from --init-from a save_pretrained directory with one): from_pretrained needs "
            "one beside the export",
            file=sys.stderr,
        )
    elif req.max_shard_size is None and split_uri(req.to)[1] != _SINGLE_NAME:
        print(
            f"ckptctl restore: note: the step records {', '.join(files)}; name the output "
            f"{_SINGLE_NAME} (or use --max-shard-size) to get them beside the weights",
            file=sys.stderr,
        )


def _export_directory(
    req: RestoreRequest, source: Storage, manifest: Manifest, sel: Selection, total: int
) -> str:
    """DCP or sharded safetensors: a local directory, empty unless `--force`."""
    directory = local_path(req.to)
    assert directory is not None  # RestoreRequest refused other destinations
    if os.path.isfile(directory):
        raise UsageError(f"--to {directory}: is a file; this format writes a directory")
    if os.path.isdir(directory) and os.listdir(directory):
        if not req.overwrite:
            raise UsageError(f"--to {directory}: directory is not empty (use --force)")
        shutil.rmtree(directory)
    progress = Progress(total, 1)
    try:
        if req.output_format is OutputFormat.DCP:
            count = export_dcp(source, manifest, sel, directory, progress=progress)
            what = "a DCP checkpoint"
        else:
            assert req.max_shard_size is not None
            count, num_files = export_sharded_safetensors(
                source,
                manifest,
                sel,
                directory,
                max_shard_bytes=parse_size(req.max_shard_size),
                chunk_bytes=req.chunk_bytes,
                progress=progress,
            )
            what = f"{num_files} safetensors shards + {INDEX_NAME}"
        progress.advance(num_files=1)
    finally:
        progress.close()
    size = format_bytes(total)
    return f"step {manifest.step}: wrote {count} tensors ({size}) as {what} to {directory}"
