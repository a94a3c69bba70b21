"""Models and data for ``benchmarks/suite.py``: seeded, generated in-process, nothing downloaded.

- ``mlp``: 512 -> 1536 -> 1536 -> 10 with GELU (~3.2M parameters), cross-entropy over 10
  classes, 32 rows per micro-batch per rank;
- ``lm``: a small causal transformer language model (vocab 2048, d_model 128, 4 heads, 3 pre-LN
  blocks, ~1.1M parameters), next-token cross-entropy on random tokens, 8 sequences x 64 tokens
  per micro-batch per rank.

``quick=True`` gives tiny versions of both (for the smoke test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """How to build one benchmark model, its data and its loss."""

    name: str
    describe: str
    micro: int  # rows (samples or sequences) per micro-batch per rank
    build: Callable[[], nn.Module]  # seeded: every call returns the same initial model
    make_batch: Callable[[torch.Generator, int], Batch]  # (generator, rows) -> (inputs, targets)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # mean over the micro-batch


def _mlp(d_in: int, hidden: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, classes),
    )


class Block(nn.Module):
    """A pre-LN transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """A causal transformer language model: token + position embeddings, blocks, LM head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _lm(vocab: int, d: int, heads: int, layers: int, seq: int) -> nn.Module:
    torch.manual_seed(0)
    return TinyLM(vocab, d, heads, layers, seq)


def _class_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def spec(name: str, quick: bool = False) -> ModelSpec:
    """The benchmark model ``name`` (``"mlp"`` or ``"lm"``); tiny sizes with ``quick``."""
    if name == "mlp":
        d_in, hidden, classes, micro = (32, 64, 10, 4) if quick else (512, 1536, 10, 32)

        def mlp_batch(gen: torch.Generator, rows: int) -> Batch:
            x = torch.randn(rows, d_in, generator=gen)
            return x, torch.randint(0, classes, (rows,), generator=gen)

        return ModelSpec(
            name,
            f"MLP {d_in}-{hidden}-{hidden}-{classes}, GELU",
            micro,
            lambda: _mlp(d_in, hidden, classes),
            mlp_batch,
            _class_loss,
        )
    if name == "lm":
        vocab, d, heads, layers, seq, micro = (
            (64, 16, 2, 1, 8, 2) if quick else (2048, 128, 4, 3, 64, 8)
        )

        def lm_batch(gen: torch.Generator, rows: int) -> Batch:
            tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
            return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

        return ModelSpec(
            name,
            f"causal LM vocab {vocab}, d_model {d}, {heads} heads, {layers} blocks, {seq} tokens",
            micro,
            lambda: _lm(vocab, d, heads, layers, seq),
            lm_batch,
            _lm_loss,
        )
    raise ValueError(f"unknown model {name!r}; choose mlp or lm")


MODELS = ("mlp", "lm")
