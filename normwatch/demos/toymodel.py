"""A small pre-norm transformer language model for the demo and the tests.

    >>> model = TinyLM(vocab=64, dim=32, depth=2, norm="rmsnorm")
    >>> logits = model(torch.randint(0, 64, (4, 16)))

``norm`` picks the normalization: ``"rmsnorm"`` / ``"layernorm"`` (torch's, which
reduce in fp32), ``"naive_rmsnorm"`` (hand-written, reduces in its input dtype: the fp16
trap), ``"batchdim_rmsnorm"`` (normalizes over the batch instead of the features: a bug).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class NaiveRMSNorm(nn.Module):
    """RMSNorm the way many codebases write it: the reduction runs in the input dtype."""

    reduce_dim = -1

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv_rms = torch.rsqrt(x.pow(2).mean(self.reduce_dim, keepdim=True) + self.eps)
        y: torch.Tensor = self.weight * (x * inv_rms)
        return y


class BatchDimRMSNorm(NaiveRMSNorm):
    """An RMSNorm with a bug: it reduces over the batch dimension, not the features."""

    reduce_dim = 0


NORMS: dict[str, Callable[[int, float], nn.Module]] = {
    "rmsnorm": lambda d, eps: nn.RMSNorm(d, eps=eps),
    "layernorm": lambda d, eps: nn.LayerNorm(d, eps=eps),
    "naive_rmsnorm": NaiveRMSNorm,
    "batchdim_rmsnorm": BatchDimRMSNorm,
}


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, t, d))
        return out


class MLP(nn.Module):
    """Two-layer GELU MLP; ``fault`` (a flag) makes it produce NaN, for failure drills."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.fault = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        if self.fault:
            h = h * torch.log(-h.abs().amax())  # log of a negative number: NaN
        out: torch.Tensor = self.down(h)
        return out


class Block(nn.Module):
    """Pre-norm block: ``h + attn(norm1(h))``, then ``h + mlp(norm2(h))``."""

    def __init__(self, dim: int, heads: int, norm: str, eps: float) -> None:
        super().__init__()
        self.norm1 = NORMS[norm](dim, eps)
        self.attn = Attention(dim, heads)
        self.norm2 = NORMS[norm](dim, eps)
        self.mlp: MLP = MLP(dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        out: torch.Tensor = h + self.mlp(self.norm2(h))
        return out


class TinyLM(nn.Module):
    """Embedding → ``depth`` pre-norm blocks → final norm → tied-free LM head.

    ``residual_scale`` multiplies the embeddings (a buffer): the demo grows it to
    reproduce a residual stream that drifts toward the fp16 limit.
    """

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        norm: str = "rmsnorm",
        eps: float = 1e-6,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"'norm' must be one of {', '.join(NORMS)}: got {norm!r}")
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.blocks: list[Block] = nn.ModuleList(  # type: ignore[assignment]
            Block(dim, heads, norm, eps) for _ in range(depth))
        self.norm = NORMS[norm](dim, eps)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.residual_scale: torch.Tensor
        self.register_buffer("residual_scale", torch.ones(()))
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[1]))
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=1.0)
            if padding_idx is not None:
                self.embed.weight[padding_idx].zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.residual_scale.to(self.embed.weight.dtype)
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.norm(h))
        return logits


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                           tokens[:, 1:].reshape(-1))


def synthetic_batch(
    generator: torch.Generator, batch: int = 8, seq: int = 32, vocab: int = 64
) -> torch.Tensor:
    """Token sequences with learnable structure: each token is (previous + 1) mod vocab
    most of the time."""
    start = torch.randint(1, vocab, (batch, 1), generator=generator)
    steps = torch.arange(seq)[None, :]
    noise = (torch.rand(batch, seq, generator=generator) < 0.1).long()
    return (start + steps + noise.cumsum(1)) % (vocab - 1) + 1
