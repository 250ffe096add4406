"""Built-in example models, named `example:NAME` on the command line.

Each is an `nn.Sequential` of coarse layers and carries its own sample input as
`model.example_input` and its loss as `model.example_loss`, so `gpipe-plan profile
example:transformer` needs neither `--input-shape` nor `--loss`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def mlp(width: int = 256, depth: int = 8, batch: int = 8, seed: int = 0) -> nn.Sequential:
    """Linear/ReLU pairs as separate layers, then a 10-way head: `depth`*2 + 1 layers."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    model = nn.Sequential(*layers)
    model.example_input = torch.randn(batch, width)  # type: ignore[assignment]
    model.example_loss = "cross_entropy"  # type: ignore[assignment]
    return model


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding: int64 tokens (B, T) -> (B, T, d)."""

    def __init__(self, vocab: int, d_model: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(max_len, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(pos)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def transformer(
    vocab: int = 512,
    d_model: int = 128,
    heads: int = 4,
    depth: int = 8,
    seq_len: int = 64,
    batch: int = 8,
    dropout: float = 0.0,
    seed: int = 0,
) -> nn.Sequential:
    """A small GPT: embedding, `depth` blocks, final norm, vocabulary head (`depth` + 3 layers)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        TokenEmbedding(vocab, d_model, seq_len),
        *[Block(d_model, heads, dropout) for _ in range(depth)],
        nn.LayerNorm(d_model),
        nn.Linear(d_model, vocab),
    )
    model.example_input = torch.randint(0, vocab, (batch, seq_len))  # type: ignore[assignment]
    model.example_loss = "cross_entropy"  # type: ignore[assignment]
    return model


EXAMPLES: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "transformer": transformer}
