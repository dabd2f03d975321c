"""Small demo models and their samples, so that `xpupack build` works with nothing else installed.

The README's first command tunes `tiny_decoder`'s blocks, which Inductor runs about twice as fast as
eager even on a 2-core CPU:

    xpupack build xpupack.examples:tiny_decoder --samples xpupack.examples:tiny_decoder_samples \\
        --modules 'layers.*' --out demo-pkg

`tiny_transformer` is plainer: on a CPU its MLP blocks (a matrix product, a GELU, another product) are too
little work for a compiled module's fixed cost per call, and they stay eager; the tests and the docs' other
examples use it.
"""

from __future__ import annotations

import math

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


# -- tiny_decoder: a block with dozens of elementwise operations, which Inductor fuses -----------------------


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a weight around 1 (``x / rms(x) * (1 + weight)``, as Gemma's)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, written out as many models write it (eight elementwise operations)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class DecoderAttention(nn.Module):
    """Causal self-attention with normalised queries and keys, rotary positions and soft-capped logits."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, hidden: int, heads: int, max_positions: int = 256, softcap: float = 50.0):
        super().__init__()
        self.heads, self.head_dim, self.softcap = heads, hidden // heads, softcap
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)
        self.out = nn.Linear(hidden, hidden, bias=False)
        frequencies = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(max_positions).float(), frequencies).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, self.head_dim).transpose(1, 3).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.cos[:seq], self.sin[:seq]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = self.softcap * torch.tanh(scores / self.softcap)
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(batch, seq, hidden))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(gelu_tanh(gate) * up)


class DecoderBlock(nn.Module):
    """Attention and a gated MLP, each between two RMS norms (before it, and on its output)."""

    def __init__(self, hidden: int, heads: int, intermediate: int):
        super().__init__()
        self.attn_norm, self.attn, self.attn_out_norm = (
            RMSNorm(hidden),
            DecoderAttention(hidden, heads),
            RMSNorm(hidden),
        )
        self.mlp_norm, self.mlp = RMSNorm(hidden), GatedMLP(hidden, intermediate)
        self.mlp_out_norm = RMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_out_norm(self.attn(self.attn_norm(x)))
        return x + self.mlp_out_norm(self.mlp(self.mlp_norm(x)))


class TinyDecoder(nn.Module):
    """A decoder in the style of Gemma 2: token ids in, soft-capped logits out.

    Each block runs about 80 small operations, most of them elementwise (norms, rotary positions, soft
    caps, the written-out GELU), around six small matrix products: eager PyTorch pays each operation's
    dispatch, and Inductor fuses them into a few loops, so the compiled block is clearly faster, also on
    a CPU. It is small on purpose: with its samples every fused loop has under 1,024 iterations, which
    Inductor runs on one thread. A bigger loop it splits over OpenMP threads, and on a 2-core machine busy
    with other work those wait for each other: the same blocks at hidden size 64 and 16 tokens then
    measured 0.45x eager in about one tune of three, and over 2x on one thread.
    """

    def __init__(
        self,
        vocab: int = 256,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 2,
        intermediate: int = 48,
        softcap: float = 30.0,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderBlock(hidden, heads, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.scale, self.softcap = math.sqrt(hidden), softcap

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) * self.scale
        for layer in self.layers:
            x = layer(x)
        return self.softcap * torch.tanh(self.head(self.norm(x)) / self.softcap)


def tiny_decoder(seed: int = 0) -> TinyDecoder:
    """The README's demo model, with deterministic weights (the norms' too, so that each one counts)."""
    torch.manual_seed(seed)
    model = TinyDecoder().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.normal_(0.0, 0.1)
    return model


def tiny_decoder_samples(seed: int = 1) -> list[torch.Tensor]:
    """Token ids for batch sizes 1 and 2, sequence length 8."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, 8), generator=generator) for batch in (1, 2)]
