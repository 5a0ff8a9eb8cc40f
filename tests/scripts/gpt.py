"""A character-level GPT trained the way the most copied scripts do it: a hand-written
LayerNorm passing eps as a literal, an evaluation in eval mode before the first step and
every few steps, AdamW, and optionally torch.compile. Never imports normwatch.

Environment: NW_STEPS (default 30), NW_COMPILE=1 (compile; after warm-up every later
step runs under set_stance("fail_on_recompile")), NW_FAULT=lr (the learning rate jumps
10000x at step NW_FAULT_STEP, default 20), NW_ACCUMULATE (micro-batches per step),
NW_EMA=1 (an EMA copy, evaluated in eval mode), NW_TWO_OPT=1 (the embeddings get their
own optimizer), NW_AMP=fp16 (fp16 autocast with a GradScaler). Under torchrun: DDP over
gloo, each rank its own batches."""

import copy
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

STEPS = int(os.environ.get("NW_STEPS", "30"))
FAULT = os.environ.get("NW_FAULT", "")
FAULT_STEP = int(os.environ.get("NW_FAULT_STEP", "20"))
ACCUMULATE = int(os.environ.get("NW_ACCUMULATE", "1"))
EVAL_EVERY = 10
torch.manual_seed(1337)

text = "".join(f"the {w} sat on the mat and saw {n} birds. " for w, n in
               zip(["cat", "dog", "owl", "fox"] * 50, range(200), strict=True))
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
block_size, batch_size = 16, 8


def get_batch(gen):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (eps written into forward)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = LayerNorm(d, bias=False)
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.ln_2 = LayerNorm(d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(),
                                 nn.Linear(4 * d, d, bias=False), nn.Dropout(0.1))

    def attn(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d=32, layers=2, heads=4):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = LayerNorm(d, bias=True)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


AMP = os.environ.get("NW_AMP") == "fp16"
DDP = int(os.environ.get("WORLD_SIZE", "1")) > 1
if DDP:
    import torch.distributed as dist

    dist.init_process_group("gloo")
model = GPT(len(chars))
ema = copy.deepcopy(model).eval() if os.environ.get("NW_EMA") == "1" else None
if os.environ.get("NW_TWO_OPT") == "1":
    embed = [model.wte.weight, model.wpe.weight]
    rest = [p for p in model.parameters() if all(p is not e for e in embed)]
    optimizers = [torch.optim.AdamW(rest, lr=3e-3), torch.optim.SGD(embed, lr=0.1)]
else:
    optimizers = [torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)]
compiled = os.environ.get("NW_COMPILE") == "1"
run_model = torch.compile(model) if compiled else model
if DDP:
    run_model = nn.parallel.DistributedDataParallel(run_model)
scaler = torch.amp.GradScaler("cpu", enabled=AMP)
gen = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))


@torch.no_grad()
def estimate_loss():
    out = {}
    run_model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(2)
        for k in range(2):
            x, y = get_batch(gen)
            losses[k] = run_model(x, y)[1].item()
        out[split] = losses.mean()
    if ema is not None:
        ema(*get_batch(gen))
    run_model.train()
    return out


for it in range(STEPS):
    if it % EVAL_EVERY == 0:
        losses = estimate_loss()
        print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    if compiled and it == 2:
        torch.compiler.set_stance("fail_on_recompile")  # warm: any recompile now raises
    if FAULT == "lr" and it + 1 == FAULT_STEP:
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] *= 1e4
    for _ in range(ACCUMULATE):
        x, y = get_batch(gen)
        with torch.autocast("cpu", dtype=torch.float16, enabled=AMP):
            logits, loss = run_model(x, y)
        scaler.scale(loss / ACCUMULATE).backward()
    for opt in optimizers:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    if ema is not None:
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)
    if not math.isfinite(loss.item()):
        print(f"iter {it}: loss is not finite")
if DDP:
    # a barrier first, as training scripts end: without it the last backward's allreduce
    # is sometimes freed by a gloo thread during interpreter finalisation, which aborts the
    # rank ("terminate called without an active exception"; torch 2.13, with or without
    # normwatch: 7 runs in 30 unwatched, none in 30 with the barrier; pytorch#179291)
    dist.barrier()
    dist.destroy_process_group()
print("script finished")
