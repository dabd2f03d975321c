"""A small demo model and its samples, so that `xpupack build` works with nothing else installed.

    xpupack build xpupack.examples:tiny_transformer --samples xpupack.examples:tiny_transformer_samples \\
        --modules 'layers.*.mlp' --out tiny-pkg
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.down(F.gelu(self.up(x))) * scale


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A decoder-only transformer: token ids in, logits out; the output head is tied to the embedding."""

    def __init__(self, vocab: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tiny_transformer(seed: int = 0) -> TinyTransformer:
    """The demo model, with deterministic weights."""
    torch.manual_seed(seed)
    return TinyTransformer().eval()


def tiny_transformer_samples(seed: int = 1) -> list[torch.Tensor]:
    """Token ids for batch sizes 1 and 2, sequence length 16."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, 16), generator=generator) for batch in (1, 2)]
