"""`trainingd prepare-data`: text files to one token file (`.bin` + JSON sidecar).

Byte-level by default (vocabulary 256, what the default GPT reads): the files' bytes, in the
order given. With `--tokenizer FILE.json` (a Hugging Face `tokenizers` file on local disk; the
`tokenizers` package must be installed, nothing is downloaded) the text is encoded with it,
and its vocabulary size goes in the sidecar. Inputs and output may be paths or fsspec URIs.

Text is read in chunks of about `_CHUNK_BYTES`, so a file of any size streams through bounded
memory; with a tokenizer a chunk ends at a line end, so no word is split between two encodes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["add_arguments", "main", "prepare", "run"]

_CHUNK_BYTES = 4 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (shared by `trainingd prepare-data` and `python -m`)."""
    parser.add_argument("inputs", nargs="+", metavar="TEXT", help="text files (path or URI)")
    parser.add_argument(
        "--out", required=True, metavar="OUT.bin", help="token file to write (path or URI)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="TOKENIZER.json",
        help="a local `tokenizers` file; default: bytes (vocabulary 256)",
    )


def _chunks(uri: str, *, whole_lines: bool) -> Iterator[bytes]:
    import fsspec

    with fsspec.open(uri, "rb") as f:
        if not whole_lines:
            while chunk := f.read(_CHUNK_BYTES):
                yield chunk
            return
        buffered: list[bytes] = []
        size = 0
        for line in f:
            buffered.append(line)
            size += len(line)
            if size >= _CHUNK_BYTES:
                yield b"".join(buffered)
                buffered, size = [], 0
        if buffered:
            yield b"".join(buffered)


def prepare(inputs: Sequence[str], out: str, tokenizer: str | None = None) -> Any:
    """Write the tokens of `inputs` (in order) to `out`; returns its `TokenFileInfo`.

    Raises:
        FileNotFoundError: an input or the tokenizer file is missing.
        ImportError: `tokenizer` is given but the `tokenizers` package is not installed.
    """
    import numpy as np

    from daemon.data.token_file import write_token_file

    if tokenizer is None:

        def byte_ids() -> Iterator[Any]:
            for uri in inputs:
                for chunk in _chunks(uri, whole_lines=False):
                    yield np.frombuffer(chunk, dtype=np.uint8)

        return write_token_file(out, byte_ids(), vocab_size=256)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            "--tokenizer needs the `tokenizers` package (pip install tokenizers)"
        ) from None
    tok = Tokenizer.from_file(tokenizer)

    def token_ids() -> Iterator[Any]:
        for uri in inputs:
            for chunk in _chunks(uri, whole_lines=True):
                text = chunk.decode("utf-8", errors="replace")
                yield np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    return write_token_file(out, token_ids(), vocab_size=tok.get_vocab_size(with_added_tokens=True))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m daemon.data.prepare`; returns the exit code (2: bad input)."""
    parser = argparse.ArgumentParser(
        prog="trainingd prepare-data", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    add_arguments(parser)
    return run(vars(parser.parse_args(argv)))


def run(args: dict[str, Any]) -> int:
    """Run the command on parsed arguments; prints one summary line, or the error."""
    try:
        info = prepare(args["inputs"], args["out"], args["tokenizer"])
    except (OSError, ValueError, ImportError) as err:
        print(f"trainingd prepare-data: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {args['out']}: {info.num_tokens} tokens ({info.dtype}, "
        f"vocabulary {info.vocab_size})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
