"""The CUDA path's host cost, measured where there is no GPU: the fused kernel's path
(``kernel="triton"``) with its launches stubbed out, so that what is left is what a
host-bound GPU step pays on the host besides Triton's launch: Python, dispatch, hooks.

    python tests/benchmarks/host.py
    python tests/benchmarks/host.py --rounds 60

Two tables, each for the launch lane (the C++ lane launching the kernel: by Triton's
launch from Python, or by a static launch from C++, here one whose launcher is a C
function that does nothing) against the Python hook alone (as
``tests/benchmarks/lane.py`` compares the CPU's):

- *per call*: what a sentinel call adds to an unwatched one, in µs of the thread's CPU
  time (torch on one thread; a machine's neighbours' time is not counted), on a stack of
  25 RMSNorms over 8 tokens x 64, copies stepped in turn, medians of paired rounds; with,
  for scale, what a Python forward hook that does nothing adds (torch's own cost of any
  module hook);
- *per step*: normwatch's Python frames in each phase of a training step (counted:
  deterministic) of a Hugging Face ``LlamaForCausalLM`` of 12 layers (25 norms),
  ``watch(model, optimizer)``, over four steps (one of them full-tier at defaults);
  also compiled (``backend="aot_eager"``: the operators' bodies run as under inductor),
  with the operators' bodies the C++ lane's or Python's.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # (nothing runs in it: launches stubbed)

import torch

import normwatch
from normwatch.measure.backends import triton_folds, triton_kernel, triton_optimizer
from normwatch.measure.backends.native import lane
from tests.benchmarks.opcount import in_kernel

PHASES = ("forward", "backward", "optimizer", "watch.step")
LAUNCHES = ((triton_kernel, "launch"), (triton_kernel, "launch_grad"),
            (triton_kernel, "launch_through"),
            (triton_folds, "launch_calls"), (triton_folds, "launch_accumulate"),
            (triton_folds, "launch_grads"), (triton_optimizer, "launch_sample"),
            (triton_optimizer, "launch_check"))


def noop_launch(kernel: Any, args: Any, constexprs: Any, grid: int, device: Any,
                warps: int = 4) -> Any:
    """A static launch (:func:`~normwatch.measure.backends.triton_launch.static_launch`'s)
    whose launcher is a C function that does nothing (``str.format``): what is left of a
    call is the lane's (room for five pointers: the most a kernel takes, the gradient
    through the norm's)."""
    return "".format, (0, grid, 1, 1, warps, 0, "OOOOO"), (None,) * 5, (0, 1, 2, 3, 4), None


@contextmanager
def static(on: bool) -> Iterator[None]:
    """Lanes planned here get the no-op static launch (``on``), else none (the CPU's)."""
    real = triton_kernel.static_launch
    if on:
        triton_kernel.static_launch = noop_launch
    try:
        yield
    finally:
        triton_kernel.static_launch = real


@contextmanager
def stubbed() -> Iterator[None]:
    """Every launch of the Triton backend does nothing (its host cost is Triton's)."""
    real = {(m, n): getattr(m, n) for m, n in LAUNCHES}
    for m, n in LAUNCHES:
        setattr(m, n, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for (m, n), f in real.items():
            setattr(m, n, f)


def llama(layers: int = 12) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))


def watched(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
            launch_lane: bool, python_bodies: bool = False, **options: Any) -> Any:
    """``watch(model, optimizer)`` on the fused kernel's path, with the launch lane or
    with the Python hook alone (``python_bodies``: compiled operators' bodies Python's,
    not the lane's); each step folds its calls for the early warning as on CUDA."""
    from normwatch.measure.step.early import EarlyWarning
    from tests.benchmarks.opcount import _Landed

    state, bodies = lane.state, lane.compiled_for
    lane.state = state if launch_lane else (lambda *args: None)  # type: ignore[assignment]
    if python_bodies:
        lane.compiled_for = lambda path, state: (path.compiled_call, path.compiled_grad)
    try:  # (as tests/benchmarks/lane.py compares the CPU's lane with the Python hook)
        w = normwatch.watch(model, optimizer, kernel="triton", report_dir=None, **options)
    finally:
        lane.state, lane.compiled_for = state, bodies  # type: ignore[assignment]
    if w.config.early_warning:
        w._early = EarlyWarning(w.config.limits.fp16_limit, _Landed, pin=False)
    return w


def per_call(rounds: int, calls: int = 50) -> dict[str, float]:
    """µs a sentinel call adds to an unwatched one, for each of :data:`KINDS` (eager) and
    ``"a hook that does nothing"``."""
    kinds = {name: kind for name, kind in KINDS.items() if kind[2] is None}
    base = torch.nn.Sequential(*[torch.nn.RMSNorm(64) for _ in range(25)])
    copies = {name: copy.deepcopy(base) for name in ("unwatched", *kinds,
                                                     "a hook that does nothing")}
    for norm in copies["a hook that does nothing"]:
        norm.register_forward_hook(lambda *args: None, with_kwargs=True)
    watches = [watched(copies[name], None, launch_lane, early_warning=False,
                       stats_every=10**6) for name, (launch_lane, _, _) in kinds.items()]
    for w in watches:
        w._measure._rt.update(full_stats=False, check_outputs=False)
    x = torch.randn(8, 64, requires_grad=True)
    times: dict[str, list[float]] = {name: [] for name in copies}
    with stubbed():
        for name, (_, launched, _) in kinds.items():  # each lane's plan made once, here
            with static(launched):
                copies[name](x)
        for _ in range(rounds + 3):
            for name, model in copies.items():
                start = time.thread_time()
                for _ in range(calls):
                    model(x)
                times[name].append((time.thread_time() - start) / calls / 25 * 1e6)
            for w in watches:  # as a step's fold does
                w._measure._rt.accumulator.reset()
                w._measure._rt.accumulator.buffers.give_back()
    for w in watches:
        w.close()
    return {name: statistics.median(b - a for a, b in zip(
        times["unwatched"][3:], times[name][3:], strict=True)) for name in copies
        if name != "unwatched"}


def per_step(layers: int = 12, **options: Any) -> dict[str, dict[str, float]]:
    """normwatch's Python frames a step, per phase, for each of :data:`KINDS` (four
    steps in steady state, averaged)."""
    base = llama(layers)
    batch = torch.randint(0, 128, (1, 8))
    found = {}
    with stubbed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the stubbed folds measure nothing: it says so)
        for name, (launch_lane, launched, compiled) in KINDS.items():
            model = copy.deepcopy(base)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            w = watched(model, optimizer, launch_lane, compiled == "Python", **options)
            run = model if compiled is None else torch.compile(model, backend="aot_eager")
            counted = dict.fromkeys(PHASES, 0.0)
            with static(launched):
                for i in range(12):
                    with frames() as count:
                        marks = [count()]
                        loss = run(batch, labels=batch).loss
                        marks.append(count())
                        loss.backward()
                        marks.append(count())
                        optimizer.step()
                        optimizer.zero_grad()
                        marks.append(count())
                        w.step(loss)
                        marks.append(count())
                    if i >= 8:
                        for phase, x, y in zip(PHASES, marks, marks[1:], strict=False):
                            counted[phase] += (y - x) / 4
            assert not w.disabled, (name, w.disabled)  # (a layer switched off: no count)
            w.close()
            found[name] = counted
    return found


KINDS = {"static launch": (True, True, None), "launch lane": (True, False, None),
         "Python hook": (False, False, None),
         "compiled, static launch": (True, True, "lane"),
         "compiled, Python bodies": (True, True, "Python")}
"""The paths compared: (a launch lane, its launches static, compiled: ``None`` not, else
whose are the operators' bodies: the lane's or Python's)."""


@contextmanager
def frames() -> Iterator[Callable[[], float]]:
    """A clock that reads the Python frames of normwatch's entered so far (its kernels'
    bodies aside: Triton's interpreter's, not the GPU's)."""
    import sys

    home = os.path.dirname(normwatch.__file__)
    seen = [0]

    def profile(frame: Any, event: str, arg: object) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(home) and not in_kernel(frame):
            seen[0] += 1

    sys.setprofile(profile)
    try:
        yield lambda: float(seen[0])
    finally:
        sys.setprofile(None)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--layers", type=int, default=12,
                        help="the Llama's layers (2 a norm each, and a last one)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (given back: the caller's may be a test session)
    try:
        added = per_call(args.rounds)
        text = "| a sentinel call | µs added |\n|---|---:|\n" + "\n".join(
            f"| {name} | {us:.1f} |" for name, us in added.items())
        text += "\n\n| steps | path | " + " | ".join(PHASES) + " | whole step |\n|---|---|" + \
            "---:|" * (len(PHASES) + 1)
        for label, options in (("defaults (full tier every 4th)", {}),
                               ("sentinel only", {"stats_every": 10**6, "flush_every": 10**6})):
            for name, phases in per_step(args.layers, **options).items():
                text += f"\n| {label} | {name} | " + " | ".join(
                    f"{phases[p]:g}" for p in PHASES) + f" | {sum(phases.values()):g} |"
    finally:
        torch.set_num_threads(threads)
    text += f"\n\n(normwatch's Python frames a step, {2 * args.layers + 1} norms, launches " \
        "stubbed)"
    print(f"torch {torch.__version__}\n\n{text}")
    return text


if __name__ == "__main__":
    main()
