"""A character-level GPT trained the way nanoGPT's ``train.py`` trains its shakespeare-char
config, for ``gpu.py``'s ``script`` part: the script issues #48 and #49 time under
``normwatch run`` (never imports normwatch). Written for this benchmark, after nanoGPT's
loop: 6 layers, 6 heads, 384 wide, blocks of 256 tokens, 64 a batch, dropout 0.2, a
LayerNorm of its own without bias (eps 1e-5 as a literal), bf16 autocast where the GPU
has it, fused AdamW (betas 0.9/0.99, weight decay on matrices), gradient clipping at
1.0, the batch for the next step fetched between forward and backward (pinned,
``non_blocking``), and a log line with ``loss.item()`` every iteration (a sync a step:
the host's work is not hidden behind the GPU's).

    python tests/benchmarks/nanogpt.py                       # NW_ITERS=60 eager steps
    NW_COMPILE=1 python tests/benchmarks/nanogpt.py          # torch.compile(model)
    normwatch run -- python tests/benchmarks/nanogpt.py      # the same, watched

Prints ``iter K: loss L, time T ms`` a step, as nanoGPT does. ``NW_DEVICE`` (default:
cuda where there is one), ``NW_TINY=1`` (2 layers, 64 wide, 4 x 32 tokens: the CPU's
check of the script).
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

TINY = os.environ.get("NW_TINY") == "1"
ITERS = int(os.environ.get("NW_ITERS", "60"))
DEVICE = os.environ.get("NW_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
LAYERS, HEADS, WIDTH, BLOCK, BATCH = (2, 2, 64, 32, 4) if TINY else (6, 6, 384, 256, 64)
VOCAB, DROPOUT = 65, 0.0 if TINY else 0.2


class LayerNorm(nn.Module):
    """A LayerNorm with an optional bias (torch's has none to turn off)."""

    def __init__(self, width: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = LayerNorm(WIDTH, False), LayerNorm(WIDTH, False)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.out = nn.Linear(4 * WIDTH, WIDTH, bias=False)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2)
                   for z in self.qkv(self.ln_1(x)).split(WIDTH, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT if self.training else 0,
                                           is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = LayerNorm(WIDTH, False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.head.weight  # tied, as nanoGPT ties them
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith(("proj.weight",
                                                                       "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def main() -> None:
    torch.manual_seed(1337)
    data = torch.randint(0, VOCAB, (200_000,))
    cuda = DEVICE.startswith("cuda")

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        at = torch.randint(len(data) - BLOCK - 1, (BATCH,))
        x = torch.stack([data[i:i + BLOCK] for i in at])
        y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in at])
        if cuda:
            return (x.pin_memory().to(DEVICE, non_blocking=True),
                    y.pin_memory().to(DEVICE, non_blocking=True))
        return x, y

    model = GPT().to(DEVICE)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": rest, "weight_decay": 0.0}], lr=1e-3,
                                  betas=(0.9, 0.99), fused=cuda or None)
    bf16 = cuda and torch.cuda.is_bf16_supported()
    ctx = torch.autocast(DEVICE.split(":")[0], torch.bfloat16, enabled=bf16)
    if os.environ.get("NW_COMPILE") == "1":
        model = torch.compile(model)  # type: ignore[assignment]
    x, y = batch()
    t0 = time.time()
    for k in range(ITERS):
        with ctx:
            loss = model(x, y)
        x, y = batch()  # (fetched while the GPU runs the forward)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        print(f"iter {k}: loss {loss.item():.4f}, time {dt * 1000:.2f}ms", flush=True)


if __name__ == "__main__":
    main()
