"""The per-call floor: normwatch's eager reads with no Python per call (CPU).

Run: ``python -m tests.benchmarks.floor [--hidden 128 --layers 4 --batch 8 --seq 64]
[--steps 300] [--modes sentinel,4,1]``.

``floor.cpp`` (built here with the C++ compiler against torch's headers, ~20 s) is a
forward hook written in C++ that reads each norm call's rows with normwatch's own C
kernels, and on measured steps adds C++ pre-hooks to the autograd nodes: the output's
gradient and the gradient through the norm computed from it, the input's gradient in
total (not the weight's: see its header). It stages, folds and flushes nothing: what it
costs is the floor of the same reads made without Python around each call.

Three copies of one tiny Llama take the same batches, one step each in turn, in
rotating order: unwatched, hooked by the floor, watched by normwatch in the same tiers
(no optimizer watched). Per 10-step block, each step time over the unwatched one's;
medians over blocks. Modes: ``sentinel`` (every call read, no gradients: normwatch with
``gradients=False`` and no full tier), or ``N`` (the full tier every ``N``-th step, with
its gradients: ``stats_every=N``).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import importlib.machinery
import importlib.util
import statistics
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from normwatch.measure.backends.native import build as native_build
from tests.benchmarks import overhead

SOURCE = Path(__file__).with_name("floor.cpp")
NAME = "normwatch_floor"


def build(folder: Path) -> ModuleType:
    """``floor.cpp`` compiled into ``folder`` and imported."""
    from torch.utils import cpp_extension

    target = folder / f"{NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    lib = Path(torch.__file__).parent / "lib"
    subprocess.run(
        ["c++", "-O2", "-fPIC", "-shared", "-std=c++20", "-w",
         *(f"-I{p}" for p in cpp_extension.include_paths()),
         f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(target),
         f"-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10",
         f"-Wl,-rpath,{lib}"], check=True)
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(target))
    spec = importlib.util.spec_from_loader(NAME, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def hooked(floor: ModuleType, model: torch.nn.Module) -> int:
    """Hook ``model``'s norms (modules named ``*Norm``) with the floor; their count."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("Norm")]
    for m in norms:
        eps = float(getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6)))
        m.register_forward_hook(functools.partial(floor.hook, eps), with_kwargs=True)
    return len(norms)


class _Traced:
    """A Python forward hook noting whether Dynamo was tracing when it ran."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def __call__(self, module: torch.nn.Module, args: object, kwargs: object,
                 output: object) -> None:
        self.seen.append(torch.compiler.is_compiling())


def compiles(floor: ModuleType) -> str:
    """Whether a model whose norm is hooked by the floor compiles whole
    (``fullgraph=True``), a Python hook standing in for the C++ one while Dynamo traces
    (``substitute_in_graph``: Dynamo cannot trace a builtin), and the C++ hook running in
    eager."""

    @torch._dynamo.substitute_in_graph(floor.hook, skip_signature_check=True)  # type: ignore[misc]
    def polyfill(python: _Traced, module: torch.nn.Module, args: object, kwargs: object,
                 output: object) -> None:
        python(module, args, kwargs, output)

    python = _Traced()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    model[1].register_forward_hook(functools.partial(floor.hook, python), with_kwargs=True)
    x = torch.randn(4, 8, requires_grad=True)
    before = floor.counts()[0]
    torch.compile(model, fullgraph=True)(x).sum().backward()
    model(x)
    return (f"compiled whole: the Python hook ran while tracing {python.seen}, the C++ hook "
            f"in eager {floor.counts()[0] - before} time(s)")


def run(floor: ModuleType, mode: str, hidden: int, layers: int, batch: int, seq: int,
        steps: int, warmup: int = 20) -> str:
    """One table row: ``mode``'s ratios over ``steps`` steps (10-step blocks) after
    ``warmup``."""
    import normwatch

    torch.manual_seed(0)
    base = overhead.tiny_llama(hidden, layers)
    models = [copy.deepcopy(base) for _ in range(3)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]
    tokens = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
    norms = hooked(floor, models[1])
    every = 1 << 30 if mode == "sentinel" else int(mode)
    watch = normwatch.watch(models[2], report_dir=None, stats_every=every,
                            gradients=mode != "sentinel")
    times: list[list[float]] = [[], [], []]
    for i in range(warmup + steps):
        for which in ((i + k) % 3 for k in range(3)):
            if which == 1:
                floor.set_full(mode != "sentinel" and i % every == 0)
            start = time.perf_counter()
            overhead.train_step(models[which], optimizers[which], tokens,
                                watch if which == 2 else None)
            times[which].append(time.perf_counter() - start)
    watch.close()
    blocks = [[sum(t[j:j + 10]) for j in range(warmup, len(t) - 9, 10)] for t in times]
    cells = []
    for which in (1, 2):
        ratio = statistics.median(b / a for a, b in zip(blocks[0], blocks[which], strict=True))
        extra = statistics.median(b - a for a, b in zip(blocks[0], blocks[which], strict=True)) / 10
        cells += [f"{ratio:.4f}x", f"{extra * 1e6:.0f}"]
    unwatched = statistics.median(times[0][warmup:]) * 1e3
    return (f"| d={hidden}, {layers} layers, {batch}x{seq} | {mode} | {norms} | "
            f"{unwatched:.1f} | " + " | ".join(cells) + " |")


def setup(floor: ModuleType) -> torch.Tensor:
    """Hand ``floor`` normwatch's kernels and a ring to write into (returned: keep it)."""

    lib = native_build.library()
    if lib is None:
        raise RuntimeError("floor: normwatch's C kernels are not built here (no C compiler)")
    ring = torch.empty(1 << 22)
    floor.setup(*(ctypes.cast(f, ctypes.c_void_p).value for f in (
        lib.normwatch_rows, lib.normwatch_grad_rows, lib.normwatch_through)),
        ring.data_ptr(), ring.numel(), torch.get_num_threads())
    return ring


def main() -> None:
    parser = overhead.side_by_side_arguments(__doc__.splitlines()[0])
    parser.add_argument("--modes", default="sentinel,4,1")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as folder:
        floor = build(Path(folder))
    ring = setup(floor)  # (kept: the hooks write into it)
    print(compiles(floor))
    print("| model | mode | norms | unwatched (ms) | C++ hooks | +µs/step | normwatch | "
          "+µs/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        print(run(floor, mode, args.hidden, args.layers, args.batch, args.seq, args.steps),
              flush=True)
    print("(C++ hooks reads, gradients read):", floor.counts())
    del ring


if __name__ == "__main__":
    main()
