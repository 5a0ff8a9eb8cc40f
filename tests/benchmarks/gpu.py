"""GPU benchmark (runs only where CUDA exists; prepared to finish in under 5 minutes).

    python tests/benchmarks/gpu.py            # prints three tables

(a) achieved bandwidth of the fused Triton kernel on a [32768, 2048] bf16 input against a
    plain device-to-device copy of the same tensor (target: >= 80 % of the copy);
(b) step overhead of normwatch at defaults on a ~125M-parameter Llama-style bf16 training
    step, interleaved with an unmonitored copy of the model (target: <= 1 %);
(c) ``torch.cuda.set_sync_debug_mode("error")`` over 50 monitored steps raises nothing.
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch

import normwatch
from normwatch.measure.triton_kernel import row_stats_triton


def time_cuda(fn, repeat: int = 50) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of ``fn`` measured with CUDA events."""
    times = []
    for _ in range(5):
        fn()
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bandwidth() -> str:
    x = torch.randn(32768, 2048, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = time_cuda(lambda: y.copy_(x))
    kernel_ms = time_cuda(lambda: row_stats_triton(x))
    nbytes = x.numel() * x.element_size()
    copy_bw = 2 * nbytes / copy_ms / 1e6  # read + write, GB/s
    kernel_bw = nbytes / kernel_ms / 1e6  # read once
    return ("| (a) [32768, 2048] bf16 | ms | GB/s |\n|---|---:|---:|\n"
            f"| device-to-device copy | {copy_ms:.3f} | {copy_bw:.0f} |\n"
            f"| fused kernel (read once) | {kernel_ms:.3f} | {kernel_bw:.0f} |\n"
            f"| kernel / copy bandwidth | | {kernel_bw / copy_bw:.1%} |")


def llama_125m() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                         max_position_embeddings=2048)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def overhead(rounds: int = 20, steps: int = 5) -> str:
    torch.manual_seed(0)
    base = llama_125m()
    plain, watched = base, copy.deepcopy(base)
    w = normwatch.watch(watched, report_dir=None)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-5) for m in (plain, watched)}
    tokens = torch.randint(0, 32000, (8, 1024), device="cuda")

    def run(model: torch.nn.Module) -> float:
        def body() -> None:
            for _ in range(steps):
                loss = model(tokens, labels=tokens).loss
                loss.backward()
                opts[id(model)].step()
                opts[id(model)].zero_grad(set_to_none=True)
                if model is watched:
                    w.step(loss)
        return time_cuda(body, repeat=1) / steps

    ratios, times = [], {"plain": [], "watched": []}
    for r in range(rounds + 1):
        order = (plain, watched) if r % 2 else (watched, plain)
        got = {id(m): run(m) for m in order}
        if r:
            times["plain"].append(got[id(plain)])
            times["watched"].append(got[id(watched)])
            ratios.append(got[id(watched)] / got[id(plain)])
    params = sum(p.numel() for p in base.parameters()) / 1e6
    return (f"| (b) Llama {params:.0f}M bf16, 8 x 1024 tokens | median step (ms) |\n|---|---:|\n"
            f"| unmonitored | {statistics.median(times['plain']):.1f} |\n"
            f"| normwatch (defaults) | {statistics.median(times['watched']):.1f} |\n"
            f"| median paired ratio | {statistics.median(ratios):.4f}x |")


def sync_free(steps: int = 50) -> str:
    torch.manual_seed(0)
    model = llama_125m()
    w = normwatch.watch(model, report_dir=None, flush_every=10**9)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, 32000, (4, 512), device="cuda")
    for _ in range(3):  # warm up (first calls allocate on the device)
        model(tokens, labels=tokens).loss.backward()
        w.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            w.step(loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    opt.zero_grad()
    assert not w.disabled, w.disabled
    return f"(c) set_sync_debug_mode('error') over {steps} monitored steps: no sync raised"


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    print(torch.cuda.get_device_name(), torch.__version__)
    for part in (bandwidth, overhead, sync_free):
        print(part())
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
