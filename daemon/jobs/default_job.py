"""The embedded default job: a byte-level GPT on a corpus generated deterministically.

No download and no data file: `corpus()` writes sentences from a small grammar with a seeded
`random.Random`, so every rank and every run sees the same bytes. The text has real structure
(word spellings, agreement, punctuation, recurring phrases), so the loss falls quickly from
ln(256) ~ 5.5 nats towards ~1 within the default run of a few hundred steps.

At the end of a completed run `sample()` shows what the model learned: the trained GPT continues
a fixed prompt by `SAMPLE_BYTES` bytes, greedily (so the same weights always write the same text),
and the daemon prints it in its summary.
"""

from __future__ import annotations

import functools
import random

import torch

from daemon.jobs.gpt import GPT, Block, GPTConfig, generate, lm_loss
from daemon.jobs.job import JobContext, JobSpec

__all__ = [
    "MODEL",
    "SAMPLE_BYTES",
    "SAMPLE_PROMPT",
    "ByteCorpus",
    "build",
    "corpus",
    "printable",
    "sample",
]

MODEL = GPTConfig(seq_len=64, num_layers=4, num_heads=4, d_model=128)
"""The default job's model: a 4-layer, 128-wide byte-level GPT."""
SAMPLE_PROMPT = b"The daemon "
"""What the trained model is asked to continue at the end of a run."""
SAMPLE_BYTES = 200
"""How many bytes it writes after the prompt."""

_SUBJECTS = ("the daemon", "a rank", "the agent", "every node", "the writer", "one shard",
             "the scheduler", "a checkpoint", "the optimizer", "the gradient")  # fmt: skip
_VERBS = ("saves", "restores", "gathers", "reduces", "commits", "streams", "shards",
          "reports", "waits for", "finalizes")  # fmt: skip
_OBJECTS = ("the weights", "a bucket", "the manifest", "its state", "the step",
            "a snapshot", "the metrics", "the buffer", "every tensor", "the marker")  # fmt: skip
_ENDINGS = (" before the next step", " in the background", " on every rank", " at once",
            " after the fence", "", "", "")  # fmt: skip


@functools.cache
def corpus(num_bytes: int = 400_000, seed: int = 1234) -> bytes:
    """Deterministic English-like text of at least `num_bytes` bytes (cached per process)."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_bytes:
        subject = rng.choice(_SUBJECTS)
        sentence = f"{subject} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        if rng.random() < 0.3:
            sentence += (
                f", then {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
            )
        sentence = sentence[0].upper() + sentence[1:] + (". " if rng.random() < 0.85 else "! ")
        if rng.random() < 0.1:
            sentence += "\n"
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts).encode()


class ByteCorpus:
    """Non-overlapping windows of a byte string: sample `i` predicts bytes `i*T+1 .. i*T+T`.

    Args:
        data: the bytes.
        seq_len: tokens per sample (`T`).
    """

    def __init__(self, data: bytes, seq_len: int) -> None:
        self._tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self._seq_len = seq_len
        self._len = (len(data) - 1) // seq_len

    def __len__(self) -> int:
        """Number of windows."""
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(inputs, targets)`: a window and the same window shifted by one byte."""
        if not 0 <= index < self._len:
            raise IndexError(index)
        start = index * self._seq_len
        chunk = self._tokens[start : start + self._seq_len + 1]
        return chunk[:-1], chunk[1:]


def printable(data: bytes) -> str:
    """`data` as text safe for a terminal.

    Printable ASCII and newlines stay as they are; every other byte (control characters, escape
    sequences, non-ASCII) is written as `\\xNN`.
    """
    return "".join(chr(b) if 32 <= b < 127 or b == 10 else f"\\x{b:02x}" for b in data)


def sample(weights: dict[str, torch.Tensor]) -> str:
    """`SAMPLE_PROMPT` and the `SAMPLE_BYTES` bytes the model with `weights` writes after it."""
    model = GPT(MODEL)
    model.load_state_dict(weights)
    return printable(SAMPLE_PROMPT + generate(model, SAMPLE_PROMPT, SAMPLE_BYTES))


def build(ctx: JobContext) -> JobSpec:
    """The default job: `MODEL` on `corpus()`, with `sample()` at the end.

    The model is built on the meta device: the engine materializes and initializes it unit
    by unit (`GPT.init_weights`, seeded from `--seed`), so no rank holds it whole first.
    """
    with torch.device("meta"):
        model = GPT(MODEL)
    return JobSpec(
        model=model,
        init_fn=model.init_weights,
        train_data=ByteCorpus(corpus(), MODEL.seq_len),
        loss_fn=lm_loss,
        unit_modules=(Block,),
        tokens_per_sample=MODEL.seq_len,
        flops_per_token=model.flops_per_token(),
        sample=sample,
    )
