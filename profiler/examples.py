"""Built-in example models, named `example:NAME` on the command line.

`mlp` and `transformer` are `nn.Sequential`s of coarse layers; `resnet` and `unet` are plain
modules with skip connections, whose graphs gpipe-plan captures. Each carries its sample input as
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


class GPT(nn.Module):
    """A GPT-2-style language model as library models write it: token and position embeddings,
    a ModuleList of blocks, a final norm and an output head whose weight is the token
    embedding's (tied). Not an nn.Sequential: gpipe-plan captures its graph."""

    def __init__(self, vocab: int, d_model: int, heads: int, depth: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tokens.weight
        # GPT-2's: N(0, 1) embeddings (torch's default) made logits of std sqrt(d_model), whose
        # softmax underflowed to denormal floats, and the head's backward on them ran 9x its
        # profile on a CPU (the profile's backward starts from a gradient of ones)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.01)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def gpt(
    vocab: int = 512,
    d_model: int = 128,
    heads: int = 4,
    depth: int = 4,
    seq_len: int = 64,
    batch: int = 8,
    seed: int = 0,
) -> nn.Module:
    """A GPT with tied input and output embeddings: `depth` blocks, cross-entropy loss."""
    torch.manual_seed(seed)
    model = GPT(vocab, d_model, heads, depth, seq_len)
    model.example_input = torch.randint(0, vocab, (batch, seq_len))  # type: ignore[assignment]
    model.example_loss = "cross_entropy"  # type: ignore[assignment]
    return model


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual; a strided 1x1 projection where the
    shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.project = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return torch.relu(h + (x if self.project is None else self.project(x)))


class ResNet(nn.Module):
    """A small residual net: a stem, stages of BasicBlocks (doubling width, halving size), a
    pooled linear head. Not an nn.Sequential: gpipe-plan captures its graph."""

    def __init__(
        self, widths: tuple[int, ...], blocks: int | tuple[int, ...], classes: int
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c = widths[0]
        per = blocks if isinstance(blocks, tuple) else (blocks,) * len(widths)
        for k, w in enumerate(widths):
            for j in range(per[k]):
                layers.append(BasicBlock(c, w, 2 if j == 0 and k > 0 else 1))
                c = w
        self.blocks = nn.ModuleList(layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def resnet(
    widths: tuple[int, ...] = (16, 32, 64),
    blocks: int | tuple[int, ...] = 2,
    size: int = 32,
    classes: int = 10,
    batch: int = 8,
    seed: int = 0,
) -> nn.Module:
    """A residual conv net with batch norm, for 3 x `size` x `size` images and `classes` classes."""
    torch.manual_seed(seed)
    model = ResNet(widths, blocks, classes)
    model.example_input = torch.randn(batch, 3, size, size)  # type: ignore[assignment]
    model.example_loss = "cross_entropy"  # type: ignore[assignment]
    return model


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.Conv2d(c_out, c_out, 3, padding=1),
        nn.ReLU(),
    )  # fmt: skip


class UNet(nn.Module):
    """Encoder, bottleneck, decoder; each decoder level concatenates the encoder's features of
    its size (the long skips that cross every cut between them)."""

    def __init__(self, channels: int, width: int, depth: int) -> None:
        super().__init__()
        widths = [width * 2**k for k in range(depth + 1)]
        self.down = nn.ModuleList()
        c = channels
        for w in widths[:-1]:
            self.down.append(_double_conv(c, w))
            c = w
        self.bottom = _double_conv(widths[-2], widths[-1])
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for w in reversed(widths[:-1]):
            self.up.append(nn.ConvTranspose2d(2 * w, w, 2, stride=2))
            self.merge.append(_double_conv(2 * w, w))
        self.out = nn.Conv2d(widths[0], channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, merge in zip(self.up, self.merge):
            x = merge(torch.cat([up(x), skips.pop()], dim=1))
        return self.out(x)


def unet(
    channels: int = 3, width: int = 8, depth: int = 3, size: int = 32, batch: int = 8, seed: int = 0
) -> nn.Module:
    """A U-Net that maps 3 x `size` x `size` images to the same shape (an mse loss)."""
    torch.manual_seed(seed)
    model = UNet(channels, width, depth)
    model.example_input = torch.randn(batch, channels, size, size)  # type: ignore[assignment]
    model.example_loss = "mse"  # type: ignore[assignment]
    return model


EXAMPLES: dict[str, Callable[[], nn.Module]] = {
    "mlp": mlp,
    "transformer": transformer,
    "gpt": gpt,
    "resnet": resnet,
    "unet": unet,
}
