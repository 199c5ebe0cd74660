"""Peak RSS of a writer uploading one shard from its staging slab to S3 (#13 item 9).

A fresh process per path maps a `--size-mib` (default 2048) shared-memory slab, as the writer
process does, uploads it to a loopback S3 server (SeaweedFS `weed mini`, disk-backed, or moto
with `--server moto`, in a separate process so neither server's memory is counted), and reports
its own peak RSS (`VmHWM`: anonymous memory plus the slab pages it touched) against the
target `1.1 x slab + 64 MiB`:

- `new`: `writer.write_shard` (the writer's real code: checksum thread + `Storage.write`,
  whose multipart parts are zero-copy views over the slab);
- `old`: what `Storage._write_s3` did before: checksum, then `fs.pipe_file(path, bytes(data))`
  (one whole copy of the shard, plus s3fs's per-part `bytes` slices).

    .venv/bin/python bench/s3_writer_rss.py [--size-mib 2048] [--server seaweed|moto]
        [--chunk-mib 64] [--concurrency 8] [--paths old,new] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import _common
from _common import MIB

_CHILD = """
import json, mmap, os, sys, time
sys.path.insert(0, {repo!r})
import _common
from ckpt_manager._save.writer import write_shard
from ckpt_manager._format.checksum import crc32
from ckpt_manager._store.storage import Storage

path, root, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
fd, size, chunk, concurrency = (int(a) for a in sys.argv[4:8])
storage = Storage(root, options)
storage.write("warm-up", b"x")  # client and event loop set up before the baseline
mm = mmap.mmap(fd, size)
view = memoryview(mm)
baseline = _common.current_rss_bytes()
t0 = time.monotonic()
if path == "new":
    write_shard(storage, "step-1/shard.bin", view, chunk_bytes=chunk, concurrency=concurrency)
else:  # the code of Storage._write_s3 before #13 item 9
    crc32(view)
    storage.backend.fs.pipe_file(
        storage.path("step-1/shard.bin"),
        bytes(view),
        mode="overwrite",
        chunksize=chunk,
        max_concurrency=concurrency,
    )
seconds = time.monotonic() - t0
print(json.dumps({{"baseline": baseline, "peak": _common.peak_rss_bytes(), "s": seconds}}))
"""


def _slab(size: int) -> int:
    fd = os.memfd_create("bench-slab")
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as mm:
        piece = os.urandom(64 * MIB)
        for start in range(0, size, len(piece)):
            mm[start : start + len(piece)] = piece[: size - start]
    return fd


def _run_child(
    path: str, root: str, options: dict[str, Any], fd: int, size: int, args: argparse.Namespace
) -> dict[str, Any]:
    code = _CHILD.format(repo=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            path,
            root,
            json.dumps(options),
            str(fd),
            str(size),
            str(args.chunk_mib * MIB),
            str(args.concurrency),
        ],
        pass_fds=(fd,),
        capture_output=True,
        text=True,
        check=False,
        cwd=_common.REPO_ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{path} writer failed:\n{done.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--server", choices=["seaweed", "moto"], default="seaweed")
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--paths", default="old,new")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from tests.support.s3 import isolate_aws_environment
    from tests.support.seaweed import SeaweedS3

    isolate_aws_environment()
    size = args.size_mib * MIB
    budget = 1.1 * size + 64 * MIB
    before = _common.machine_conditions()
    fd = _slab(size)
    with tempfile.TemporaryDirectory(prefix="bench-s3-rss-") as tmp:
        server: Any
        if args.server == "seaweed":
            server = SeaweedS3(pathlib.Path(tmp), bucket="bench").start()
            target = server.default_target()
        else:
            server = _MotoProcess().start()
            target = server.target
        try:
            rows = []
            report: dict[str, Any] = {"size_mib": args.size_mib, "budget_mib": budget / MIB}
            for path in args.paths.split(","):
                root = f"{target.uri}/{path}-{uuid.uuid4().hex[:8]}"
                got = _run_child(path, root, dict(target.storage_options), fd, size, args)
                rss_ratio = got["peak"] / budget
                report[path] = {**got, "ratio": rss_ratio}
                rows.append(
                    [
                        path,
                        got["baseline"] / MIB,
                        got["peak"] / MIB,
                        budget / MIB,
                        rss_ratio,
                        got["s"],
                        "meets" if rss_ratio <= 1.0 else "MISSES",
                    ]
                )
        finally:
            server.stop()
            os.close(fd)
    report["conditions"] = _common.conditions_line(before, _common.machine_conditions())
    if args.json:
        _common.print_json(report)
        return 0
    print(
        f"{args.size_mib} MiB slab to {args.server} on loopback, parts of {args.chunk_mib} MiB, "
        f"{args.concurrency} in flight; target peak RSS <= 1.1 x slab + 64 MiB"
    )
    print(
        _common.markdown_table(
            [
                "path",
                "RSS before upload (MiB)",
                "peak RSS (MiB)",
                "budget (MiB)",
                "peak/budget",
                "upload s",
                "",
            ],
            rows,
        )
    )
    print(report["conditions"])
    return 0


class _MotoProcess:
    """moto's server in its own process, so its copy of the object is not in ours."""

    def start(self) -> _MotoProcess:
        from tests.support.dist import free_port
        from tests.support.s3 import S3Target

        port = free_port()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.target = S3Target(f"http://127.0.0.1:{port}", "bench")
        deadline = time.monotonic() + 30
        while True:
            try:
                fs = self.target.filesystem()
                from fsspec.asyn import sync

                sync(fs.loop, fs._call_s3, "create_bucket", Bucket="bench")
                return self
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
