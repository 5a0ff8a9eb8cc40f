"""GPU benchmark (runs only where CUDA exists; prepared to finish in under 5 minutes).

    python tests/benchmarks/gpu.py            # prints the tables

(a) achieved bandwidth of the fused Triton kernel on a [32768, 2048] bf16 input against a
    plain device-to-device copy of the same tensor (target: >= 80 % of the copy), and the
    whole per-call statistics (reductions + fold) two ways: the fused kernel in eager, and
    the torch reductions compiled by inductor (what a compiled hook runs);
(b) step overhead of normwatch at defaults on a ~125M-parameter Llama-style bf16 training
    step, interleaved with an unmonitored copy of the model (target: <= 1 %), eager,
    compiled, and compiled with ``mode="reduce-overhead"`` (CUDA graphs; skips counted);
(c) ``torch.cuda.set_sync_debug_mode("error")`` over 50 monitored steps raises nothing,
    eager and compiled;
(d) the optimizer watched (``watch(model, optimizer)``): step ratio against an unmonitored
    copy and the peak memory of a step (``max_memory_allocated``) with and without the
    watch, against 1/16 of the parameters' bytes.
"""

from __future__ import annotations

import copy
import statistics
import sys
import traceback

import torch

import normwatch
from normwatch.measure.backends.triton_kernel import row_stats_triton


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
            f"| kernel / copy bandwidth | | {kernel_bw / copy_bw:.1%} |\n"
            f"{per_call_statistics(x)}")


def per_call_statistics(x: torch.Tensor) -> str:
    """One norm call's statistics, reductions and fold: fused kernel vs inductor."""
    from normwatch.measure.backends.torchops import reduce_call
    from normwatch.measure.backends.triton_kernel import TRITON
    from normwatch.measure.state.fold import fold_calls, fold_plan
    from normwatch.measure.state.rows import LayerRows
    from normwatch.records import Limits, NormLayer

    plan = fold_plan([reduce_call(x, x, "rmsnorm", 1e-6, True, 0, 0.0)], Limits())
    rows = LayerRows.of(NormLayer("norm", "rmsnorm", 1e-6, (x.shape[1],), "w", "RMSNorm"), 0)

    def fused() -> torch.Tensor:
        return fold_calls([TRITON.call_rows(rows, x, x, 0.0, True)], plan)

    def torch_path(x: torch.Tensor) -> torch.Tensor:
        return fold_calls([reduce_call(x, x, "rmsnorm", 1e-6, True, 0, 0.0)], plan)

    compiled = torch.compile(torch_path, fullgraph=True)
    fused_ms = time_cuda(fused)
    inductor_ms = time_cuda(lambda: compiled(x))
    return (f"| per call, input and output (fold included): fused kernel, eager | {fused_ms:.3f}"
            f" | |\n| per call: torch reductions compiled by inductor | {inductor_ms:.3f} | |")


def llama_125m() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                         max_position_embeddings=2048)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def overhead(mode: str | None = None, rounds: int = 20, steps: int = 5) -> str:
    """``mode``: ``None`` (eager) or a ``torch.compile`` mode for both models."""
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    torch.manual_seed(0)
    base = llama_125m()
    plain, watched = base, copy.deepcopy(base)
    w = normwatch.watch(watched, report_dir=None)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-5) for m in (plain, watched)}
    calls = {id(m): m if mode is None else torch.compile(m, mode=mode)
             for m in (plain, watched)}
    tokens = torch.randint(0, 32000, (8, 1024), device="cuda")

    def run(model: torch.nn.Module) -> float:
        def body() -> None:
            for _ in range(steps):
                loss = calls[id(model)](tokens, labels=tokens).loss
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
    label = "eager" if mode is None else f"compiled ({mode})"
    compiled = "" if mode is None else (
        f"| graphs / graph breaks / cudagraph skips | {counters['stats']['unique_graphs']} / "
        f"{sum(counters['graph_break'].values())} / "
        f"{sum(counters['inductor'].get(k, 0) for k in counters['inductor'] if 'skip' in k)} |\n")
    w.close()
    return (f"| (b) Llama {params:.0f}M bf16, 8 x 1024 tokens, {label} | median step (ms) |\n"
            f"|---|---:|\n"
            f"| unmonitored | {statistics.median(times['plain']):.1f} |\n"
            f"| normwatch (defaults) | {statistics.median(times['watched']):.1f} |\n"
            f"{compiled}| median paired ratio | {statistics.median(ratios):.4f}x |")


def sync_free(steps: int = 50, compiled: bool = False) -> str:
    torch.compiler.reset()
    torch.manual_seed(0)
    model = llama_125m()
    w = normwatch.watch(model, report_dir=None, flush_every=10**9)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, 32000, (4, 512), device="cuda")
    call = torch.compile(model) if compiled else model
    for _ in range(3):  # warm up (first calls allocate on the device, or compile)
        call(tokens, labels=tokens).loss.backward()
        w.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            loss = call(tokens, labels=tokens).loss
            loss.backward()
            w.step(loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    opt.zero_grad()
    assert not w.disabled, w.disabled
    assert w.flush().layers["model.norm"].calls == steps + 3
    w.close()
    return (f"(c) set_sync_debug_mode('error') over {steps} monitored steps"
            f"{' (compiled)' if compiled else ''}: no sync raised")


def optimizer_watch(rounds: int = 10, steps: int = 5) -> str:
    """(d): each model steps alone between peak-memory resets, so each peak is its own."""
    torch.manual_seed(0)
    base = llama_125m()
    plain, watched = base, copy.deepcopy(base)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-5) for m in (plain, watched)}
    w = normwatch.watch(watched, opts[id(watched)], report_dir=None)
    tokens = torch.randint(0, 32000, (8, 1024), device="cuda")
    peaks: dict[int, list[int]] = {id(plain): [], id(watched): []}

    def run(model: torch.nn.Module) -> float:
        def body() -> None:
            for _ in range(steps):
                loss = model(tokens, labels=tokens).loss
                loss.backward()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                opts[id(model)].step()  # the monitor's copy lives inside step()
                torch.cuda.synchronize()
                peaks[id(model)].append(torch.cuda.max_memory_allocated() - before)
                opts[id(model)].zero_grad(set_to_none=True)
                if model is watched:
                    w.step(loss)
        return time_cuda(body, repeat=1) / steps

    ratios = []
    for r in range(rounds + 1):
        order = (plain, watched) if r % 2 else (watched, plain)
        got = {id(m): run(m) for m in order}
        if r:
            ratios.append(got[id(watched)] / got[id(plain)])
    w.close()
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters())
    extra = statistics.median(peaks[id(watched)][steps:]) - \
        statistics.median(peaks[id(plain)][steps:])
    return (f"| (d) optimizer watched, Llama {nbytes / 2e6:.0f}M bf16 | |\n|---|---:|\n"
            f"| median paired step ratio | {statistics.median(ratios):.4f}x |\n"
            f"| optimizer step peak, unmonitored (MiB) | "
            f"{statistics.median(peaks[id(plain)][steps:]) / 2**20:.1f} |\n"
            f"| what the watch adds to it (MiB) | {extra / 2**20:.1f} |\n"
            f"| 1/16 of the parameters (MiB) | {nbytes / 16 / 2**20:.1f} |")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    print(torch.cuda.get_device_name(), torch.__version__)
    parts = (bandwidth, overhead, lambda: overhead("default", rounds=10),
             lambda: overhead("reduce-overhead", rounds=10), sync_free,
             lambda: sync_free(compiled=True), optimizer_watch)
    for part in parts:  # each on its own: one failure does not lose the others
        try:
            print(part(), flush=True)
        except Exception:  # (printed, then the next part)
            traceback.print_exc()
            sys.stdout.flush()
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
