"""Tiny Hugging Face models built in code (no downloads): Llama, Qwen2 and GPT-2 shapes.

Two layers, hidden size 32, vocabulary 64: enough for rotary buffers, tied and untied heads
and attention masks, small enough for a CPU test. `tests/conftest.py` sets the offline
variables before anything imports transformers.
"""

from __future__ import annotations

import os

import torch
from torch import nn

for _name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")

VOCAB = 64
"""Vocabulary size of every tiny model."""


def tiny_config(kind: str, *, tied: bool = False) -> object:
    """A 2-layer config of `kind` (`llama`, `qwen2` or `gpt2`)."""
    import transformers

    # Llama and Qwen2 share their config's fields (Qwen2's are Llama's with a sliding window).
    llama_like = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
    }
    if kind == "llama":
        return transformers.LlamaConfig(**llama_like)
    if kind == "qwen2":
        return transformers.Qwen2Config(**llama_like)
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            # No dropout (Llama's and Qwen2's configs have none either): a training step is
            # the same computation on every strategy, so parity tests can compare steps.
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    raise ValueError(f"unknown tiny model kind {kind!r}")


def tiny_model(kind: str, *, seed: int = 0, tied: bool = False) -> nn.Module:
    """A freshly initialised tiny causal LM of `kind` (fp32, on the CPU)."""
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        tiny_config(kind, tied=tied), attn_implementation="eager"
    )
