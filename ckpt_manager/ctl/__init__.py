"""`ckptctl`, the operator's command line: list, show, verify, restore, prune, pin, unpin.

The engine never imports this package. `list`, `show` and `verify` stay torch-free (only
`restore`'s export, reshard and stream modules import torch, when they run), so they start in
well under a second.

    cli.py          argument parsing, subcommand dispatch, exit codes (the console script).
    errors.py       UsageError: the command line is wrong (exit 2).
    common.py       storage flags, opening a root, resolving `latest` / step numbers,
                    one-line messages for operator-fixable failures.
    list.py         `list`: one row per step from its manifest, plus the lease holder.
    inspect.py      `show` and `verify`.
    prune.py        `prune` (retention offline; `--corrupt`: quarantined and corrupt steps),
                    `pin` / `unpin`.
    retention.py    the manager's policies labelled for humans.
    render.py       human output: sizes, times, ages, tables, a TTY progress bar.
    restore.py      `restore`: verify, then consolidate or reshard.
    export.py       consolidated torch / safetensors files.
    export_sharded.py  Hugging Face sharded safetensors + index (`--max-shard-size`).
    export_dcp.py   a torch DCP checkpoint directory (`--format dcp`).
    reshard.py      a new checkpoint for another world size, written like a save (format
                    2) under the destination's lease and published by the one commit path.
    stream.py       a stored tensor as bounded chunks of row-major bytes.
    sink.py         where a produced file goes: local disk or any fsspec URL.
"""
