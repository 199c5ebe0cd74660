"""A small GPT-style byte-level language model: the default job's model and the test/bench model.

Kept deliberately plain (pre-norm blocks, causal self-attention, GELU MLP) so that parity tests
against an unsharded reference exercise the sharding engine, not exotic layers. `Block` is the
repeated transformer block: the natural FSDP unit.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "GPTConfig", "generate", "lm_loss"]


@dataclasses.dataclass(kw_only=True, frozen=True)
class GPTConfig:
    """Shape of a `GPT`."""

    vocab_size: int = 256
    """Number of token ids; 256 for byte-level text."""
    seq_len: int = 64
    """Maximum sequence length (size of the learned position table)."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block; must divide `d_model`."""
    d_model: int = 128
    """Width of the residual stream."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs deterministic)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by num_heads "
                f"({self.num_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.num_heads, c // self.num_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    """One pre-norm transformer block (the FSDP unit)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level GPT returning logits of shape `(batch, seq, vocab)`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 scaled init of residual projections keeps early losses near log(vocab).
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "out.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.num_layers))

    def init_weights(self, module: nn.Module) -> None:
        """Initialize `module`'s own parameters in place, with this model's scheme.

        Linear and embedding weights ~ N(0, 0.02) (the residual projections `attn.proj`
        and `out` ~ N(0, 0.02 / sqrt(2 * num_layers))), biases 0, other modules (the
        LayerNorms) their `reset_parameters()`. The `init_fn` of deferred init for a GPT
        built on the meta device (`sharding.DeferredInit(init_fn=gpt.init_weights)`); the
        constructor draws the same distributions from the global generator.
        """
        blocks: list[Block] = list(self.blocks)  # type: ignore[arg-type]
        residual = any(module is b.attn.proj or module is b.out for b in blocks)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * self.cfg.num_layers) if residual else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            bias = getattr(module, "bias", None)
            if bias is not None:
                nn.init.zeros_(bias)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def flops_per_token(self) -> float:
        """Model FLOPs of one trained token (forward and backward) at full `seq_len`.

        `6 * N + 12 * num_layers * d_model * seq_len` (PaLM, appendix B; nanoGPT's
        `estimate_mfu`): each weight of a matmul costs 2 FLOPs per token forward and 4
        backward, and attention's two `seq_len`-long products (QK^T, AV) cost
        `2 * 2 * d_model * seq_len` per layer forward, times 3 with backward. N counts the
        weights that take part in a matmul: every parameter except the position table (a
        lookup) and, when the head is not tied to it, the token table (a lookup too; tied, it
        is the head's matmul). Causal masking is not discounted, so figures compare with
        published MFUs.
        """
        lookups = {id(self.pos_emb.weight)}
        if self.head.weight is not self.tok_emb.weight:
            lookups.add(id(self.tok_emb.weight))
        num_matmul = sum(p.numel() for p in self.parameters() if id(p) not in lookups)
        cfg = self.cfg
        return float(6 * num_matmul + 12 * cfg.num_layers * cfg.d_model * cfg.seq_len)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids `(batch, seq)` to logits `(batch, seq, vocab)`."""
        _, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def generate(
    model: GPT, prompt: bytes, num_bytes: int, *, temperature: float = 0.0, seed: int = 0
) -> bytes:
    """The `num_bytes` bytes the model writes after `prompt`, one at a time.

    Deterministic: greedy (the most likely byte) at `temperature` 0, else sampled from the
    softmax of logits / `temperature` with a generator seeded by `seed`. The context is the
    last `seq_len` bytes. The model is put in eval mode for the call and its mode restored.

    Raises:
        ValueError: empty prompt, negative `num_bytes` or `temperature`.
    """
    if not prompt:
        raise ValueError("generate() needs a non-empty prompt")
    if num_bytes < 0 or temperature < 0:
        raise ValueError(
            f"generate(num_bytes={num_bytes}, temperature={temperature}): use 0 or more"
        )
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    try:
        with torch.inference_mode():  # no autograd graph per generated byte
            for _ in range(num_bytes):
                context = torch.tensor([tokens[-model.cfg.seq_len :]])
                logits = model(context)[0, -1]
                if temperature == 0:
                    token = int(logits.argmax())
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    token = int(torch.multinomial(probs, 1, generator=generator))
                tokens.append(token)
    finally:
        model.train(was_training)
    return bytes(tokens[len(prompt) :])
