"""What inductor generates for a watched model against the unwatched one (deterministic:
counted in the generated code, not timed).

Run: ``python -m tests.benchmarks.compiled_kernels [--depth 2] [--dim 64]``.

One training step (forward and backward) of a pre-norm ``TinyLM`` (``nn.RMSNorm``)
compiled with ``fullgraph=True``, the whole model or each block, watched at defaults and
unwatched. From the code inductor writes (``run_and_get_code``) per configuration:

- *graphs*: the compiled graphs (forward and backward: one block's serve every block);
- *kernels*: the kernels it generates (CPU: C++ functions, CUDA: Triton kernels), each
  once however often it runs;
- *launches*: the kernels' calls in a step. Where normwatch's statistics fuse with the
  norm's own loops this does not grow; each norm call that gets a kernel of its own adds
  one.
- *extern calls*: the library calls (matmuls, attention);
- *normwatch calls*: calls of normwatch's operators in the graphs
  (``normwatch::observe``, ``normwatch::observe_grad``): each runs Python at run time,
  and each is a point inductor cannot fuse across or capture in a CUDA graph (#49: the
  target is none, with compile time kept: ``compile_time.py``).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # before torch loads

import torch
from torch._inductor.utils import run_and_get_code

from normwatch.demos.toymodel import lm_loss
from tests.benchmarks.compile_time import compiled_tinylm, table

_KERNEL = re.compile(r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp|triton)\(", re.M)
_CALL = re.compile(r"^\s+(\w+)(?:\.run)?\(", re.M)
_EXTERN = re.compile(r"\bextern_kernels\.\w+\(")
_NORMWATCH = re.compile(r"\btorch\.ops\.normwatch\.\w+")


@dataclass(frozen=True)
class Generated:
    """What inductor wrote for one step (see the module docstring)."""

    graphs: int
    kernels: tuple[str, ...]
    launches: tuple[int, ...]
    """Per graph (forward, backward)."""
    extern_calls: int
    normwatch_calls: tuple[str, ...]
    gradients_measured: int = 0
    """Watched: the layers whose three gradients (output, through the norm, hidden
    state) were measured in that step."""
    calls_measured: int = 0
    """Watched: the layers whose calls' statistics (tokens, RMS) were measured in it."""


def generated(code: Sequence[str]) -> Generated:
    """Count the generated ``code`` of a run's graphs."""
    text = "\n".join(code)
    kernels = tuple(_KERNEL.findall(text))
    called = set(kernels)
    launches = tuple(sum(name in called for name in _CALL.findall(c)) for c in code)
    return Generated(len(code), kernels, launches, len(_EXTERN.findall(text)),
                     tuple(m.rsplit(".", 1)[1] for m in _NORMWATCH.findall(text)))


def one_step(watched: bool, per_block: bool, depth: int = 2, dim: int = 64) -> Generated:
    """Compile and run one training step of a fresh ``TinyLM`` (see the module docstring)."""
    with compiled_tinylm(depth, dim, watched, per_block) as (_, run, watch, tokens):
        _, code = run_and_get_code(lambda: lm_loss(run(tokens), tokens).backward())
        measured = calls = 0
        if watch is not None:
            layers = watch.flush().layers.values()
            measured = sum(None not in (s.grad_out_rms, s.grad_in_rms, s.grad_hidden_rms)
                           for s in layers)
            calls = sum(s.tokens == tokens.numel() and s.rms_max is not None for s in layers)
    return replace(generated(code), gradients_measured=measured, calls_measured=calls)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args(argv)
    norms = 2 * args.depth + 1
    title = (f"TinyLM, {args.depth} blocks, {norms} norm calls a step ({torch.__version__}, "
             f"{'CUDA' if torch.cuda.is_available() else 'CPU'} inductor)")

    def rows() -> Iterator[str]:
        for per_block in (False, True):
            for watched in (False, True):
                g = one_step(watched, per_block, args.depth, args.dim)
                yield f"| {'per block' if per_block else 'whole'} | " \
                      f"{'yes' if watched else 'no'} | {g.graphs} | {len(g.kernels)} | " \
                      f"{' + '.join(map(str, g.launches))} | " \
                      f"{g.extern_calls} | {len(g.normwatch_calls)} |"

    header = ("compile | watched | graphs: | kernels: | launches (fwd + bwd): | "
              "extern calls: | normwatch calls:")
    text = title + "\n\n" + table(header, rows())
    print(text)
    return text


if __name__ == "__main__":
    main()
