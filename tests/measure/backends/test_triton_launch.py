"""The fused kernels launched from C++ (normwatch.measure.backends.triton_launch): a static
launch passes what the compiled kernel takes (its PTX's parameters, compiled for an
sm_90 GPU on this CPU), and the lanes launch it with the call's pointers and no Python of
normwatch's: here through a stand-in for torch's static CUDA launcher that runs the
kernel in Triton's interpreter on the memory the pointers name, so that the rows it
writes are checked against Triton's own launch. Skips cleanly where Triton is absent."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import normwatch
from normwatch.measure.backends import triton_kernel
from normwatch.measure.backends.native import lane as fastlane
from normwatch.measure.backends.triton_launch import compiled_spec, static_launch
from tests.benchmarks.overhead import tiny_llama, train_step
from tests.measure.backends.test_triton_kernel import compiled_for_sm90

_PTX = """
import json, re, sys, warnings
warnings.filterwarnings("ignore")
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from normwatch.measure.backends.triton_kernel import _grad_kernel, _kernel
from normwatch.measure.backends.triton_launch import compiled_spec

TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}
cases = []
for kernel, args, constexprs in (
        (_kernel(), ("x_ptr", torch.bfloat16, "y_ptr", torch.bfloat16, "rows_ptr",
                     torch.float32, "n_tokens", 96, "width", 64, "sxt", 64, "sxd", 1,
                     "syt", 64, "syd", 1),
         {"HAS_OUT": True, "FULL": True, "CENTRED": True, "BLOCK_D": 64, "TOKENS": 1}),
        (_kernel(), ("x_ptr", torch.bfloat16, "y_ptr", torch.bfloat16, "rows_ptr",
                     torch.float32, "n_tokens", 1, "width", 48, "sxt", 48, "sxd", 1,
                     "syt", 48, "syd", 1),
         {"HAS_OUT": True, "FULL": False, "CENTRED": False, "BLOCK_D": 64, "TOKENS": 1}),
        (_grad_kernel(), ("g_ptr", torch.bfloat16, "p_ptr", torch.bfloat16, "rows_ptr",
                          torch.float32, "n_tokens", 8, "width", 64),
         {"HAS_PART": True, "BLOCK_D": 64, "TOKENS": 1})):
    values = dict(zip(args[::2], args[1::2]))
    # as Triton's JIT specializes: an int of 1 is a constexpr
    signature = {name: TYPES[v] if isinstance(v, torch.dtype) else
                 "constexpr" if v == 1 else "i32" for name, v in values.items()}
    constants = {name: v for name, v in values.items() if signature[name] == "constexpr"}
    signature.update({name: "constexpr" for name in constexprs})
    try:
        made = triton.compile(ASTSource(kernel, signature, {**constants, **constexprs}),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as exc:  # no CUDA backend or ptxas in this Triton, another API
        print(json.dumps({"skip": repr(exc)[-400:]}))
        sys.exit(0)
    head, kept, places = compiled_spec(made, {**values, **constexprs}, values["n_tokens"])
    entry = re.search(r"\\.entry\\s+\\w+\\s*\\((.*?)\\)", made.asm["ptx"], re.S).group(1)
    cases.append({"head": list(head), "kept": list(kept), "places": list(places),
                  "params": re.findall(r"\\.param\\s+\\.(\\w+)", entry)})
print(json.dumps(cases))
"""
"""Compiles the kernels for an sm_90 GPU as Triton's JIT would for a lane's launch (a
full-tier call, a one-token sentinel call, a gradient with a part) and prints each
one's static launch and its PTX entry's parameters (Triton's compiler and ptxas run on
the CPU, not under its interpreter: hence a process of its own)."""


def test_a_static_launch_passes_what_the_compiled_kernel_takes() -> None:
    """#48 item 1: the static launcher passes each argument as its format letter says (a
    pointer 8 bytes, an i32 4), so the letters must be the compiled kernel's parameters,
    in order: its pointers, its ints but those Triton made constants (an int of 1: the
    element strides, a call of one token), its scratch pointers last (null); the call's
    pointers go where the pointers are."""
    cases = compiled_for_sm90(_PTX)
    ptx = {"O": "u64", "i": "u32", "l": "u64"}
    for case in cases:
        kinds = case["head"][6]
        assert [ptx[k] for k in kinds] == case["params"], case
        assert case["places"][:3] == [0, 1, 2], case  # (the call's three pointers)
        kept = case["kept"]  # (the pointers' places empty: the call's, then the scratch)
        assert [i for i, v in enumerate(kept) if v is None] == \
            [0, 1, 2, len(kept) - 2, len(kept) - 1], case
    full, single, grad = cases
    assert full["head"][1:4] == [96, 1, 1] and full["head"][6] == "OOOiiiiOO"
    assert full["kept"][3:7] == [96, 64, 64, 64]  # tokens, width, the token strides
    assert full["places"][3:9] == [3, 4, 5, -1, 6, -1]  # (the element strides: constants)
    assert single["places"][3] == -1 and grad["places"][3:5] == [3, 4]
    assert single["head"][6] == "OOOiiiOO" and single["kept"][3:6] == [48, 48, 48]  # (1 token)
    assert grad["head"][6] == "OOOiiOO" and grad["kept"][3:5] == [8, 64]


_POINTEES = {torch.float32: "*fp32", torch.float64: "*fp64", torch.int64: "*i64",
             torch.int32: "*i32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def jit_compiled(kernel: Any, args: Any, constexprs: dict[str, Any], warps: int,
                 **metadata: Any) -> tuple[list[str], dict[str, Any], dict[str, str], Any]:
    """``kernel`` as Triton's JIT compiles it for ``args`` (a dtype for each pointer) and
    ``constexprs`` (an int of 1 a constant, a float ``fp32``, an int past 32 bits
    ``i64``), as far as :func:`compiled_spec` reads one: its argument names, their
    values, its signature and the compiled stand-in (``metadata``: more of its fields)."""
    names = list(kernel.arg_names)
    values = {**dict(zip(names, args, strict=False)), **constexprs}
    signature = {
        name: "constexpr" if name in constexprs or (isinstance(v, int) and v == 1) else
        _POINTEES[v] if isinstance(v, torch.dtype) else "fp32" if isinstance(v, float)
        else "i32" if -2**31 <= v < 2**31 else "i64" for name, v in values.items()}
    compiled = SimpleNamespace(
        src=SimpleNamespace(fn=kernel, signature=signature, constants={}),
        metadata=SimpleNamespace(num_warps=warps, shared=0, num_ctas=1, **metadata))
    return names, values, signature, compiled


class StandIn:
    """A stand-in for torch's static CUDA launcher (``_StaticCudaLauncher._launch_kernel``,
    which a CPU build of torch has not) for the specs :meth:`spec` makes: it reads the
    call's arguments as the real one does, by the format letters, finds the memory each
    pointer names, and runs the kernel on it in Triton's interpreter."""

    def __init__(self) -> None:
        self.launches = 0
        self.launched: dict[str, int] = {}
        """Launches by kernel name."""

    def spec(self, kernel: Any, args: Any, constexprs: dict[str, Any], grid: int,
             device: torch.device, warps: int = 4) -> Any:
        """:func:`static_launch`'s spec for the CPU: a compiled kernel as Triton's JIT
        specializes one (an int of 1 a constant), made into a spec by the module's own
        :func:`compiled_spec`, launched by :meth:`launch`."""
        names, values, signature, compiled = jit_compiled(
            kernel, args, constexprs, warps, global_scratch_size=0, profile_scratch_size=0)
        made = compiled_spec(compiled, values, grid)
        assert made is not None
        head, kept, places = made
        n, width = values["n_tokens"], values["width"]
        rows = n * (triton_kernel.row_count(True, constexprs["FULL"])
                    if "FULL" in constexprs else 2)
        counts = {name: rows if name in ("rows_ptr", "out_ptr", "in_ptr") else
                  width if name == "w_ptr" else n * width
                  for name, kind in signature.items() if kind.startswith("*")}

        def launch(function: int, gx: int, gy: int, gz: int, num_warps: int, shared: int,
                   kinds: str, got: tuple[Any, ...], stream: int) -> None:
            assert (gx, gy, gz, num_warps, kinds) == (grid, 1, 1, warps, head[6])
            assert len(got) == len(kinds) and stream == 0
            given = iter(got)
            positional = []
            for name in names:
                if name in constexprs:
                    continue
                if signature[name] != "constexpr":
                    value = next(given)
                    if signature[name].startswith("*"):  # the memory the pointer names
                        dtype = values[name]
                        memory = (ctypes.c_byte * (counts[name] * dtype.itemsize)
                                  ).from_address(value)
                        value = torch.frombuffer(memory, dtype=dtype)
                    positional.append(value)
                else:
                    positional.append(values[name])
            self.launches += 1
            self.launched[kernel.__name__] = self.launched.get(kernel.__name__, 0) + 1
            kernel[(gx,)](*positional, **constexprs, num_warps=num_warps)

        return launch, head, kept, places, None


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> StandIn | None:
    """The stand-in's static launches on the CPU; on a GPU torch's own (``None``)."""
    if fastlane.module() is None:
        pytest.skip("no C++ lane here (no C++ compiler, torch headers or C library)")
    if not triton_kernel.usable():
        pytest.skip("Triton cannot run here")
    if DEVICE.type == "cuda":
        return None
    made = StandIn()
    monkeypatch.setattr(triton_kernel, "static_launch", made.spec)
    return made


def _steps(dtype: torch.dtype, steps: int = 3, offset: bool = False
           ) -> tuple[list[float], Any, dict[str, int]]:
    """A tiny Llama in ``dtype`` trained ``steps`` full-tier steps with the fused kernel
    (``offset``: each norm's input 2 bytes past an aligned address): its losses, its
    flush, and how often normwatch's Python launched each kernel after the first step
    (whose first calls, the interval's output check, are the Python hook's). On a GPU the
    attention is the math backend's, whose backward is deterministic: two runs are then
    bit-identical."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = tiny_llama(32, 2).to(DEVICE, dtype)
    if offset:
        for layer in [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]:
            layer.register_forward_pre_hook(
                lambda m, a: (torch.cat([a[0].new_zeros(1), a[0].flatten()])[1:]
                              .view_as(a[0]),))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = normwatch.watch(model, opt, report_dir=None, kernel="triton", stats_every=1,
                            flush_every=100, early_warning=False)
    python = {"launch": 0, "launch_grad": 0}
    real = {name: getattr(triton_kernel, name) for name in python}

    def spy(name: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> None:
            python[name] += 1
            real[name](*args, **kwargs)
        return counted

    tokens = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(DEVICE)
    try:
        for name in python:
            setattr(triton_kernel, name, spy(name))
        losses = []
        for step in range(steps):
            losses.append(train_step(
                model, opt, tokens, watch, context=(lambda: sdpa_kernel(SDPBackend.MATH))
                if DEVICE.type == "cuda" else contextlib.nullcontext).item())
            if step == 0:
                python.update(launch=0, launch_grad=0)
        snap = watch.flush()
        assert not watch.disabled, watch.disabled  # (no layer lost on the way)
    finally:
        for name, fn in real.items():
            setattr(triton_kernel, name, fn)
        watch.close()
    return losses, snap, python


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lanes_launch_the_static_launch_and_read_what_tritons_launch_reads(
        standin: StandIn | None, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """#48 item 1: where a lane's plan has a static launch, the C++ lanes launch every
    call and every gradient site through it (no Python of normwatch's on the way), and
    the statistics are those of Triton's own launch, every one of them, bit for bit (on
    a GPU: torch's static launcher against Triton's)."""
    losses, snap, python = _steps(dtype)
    assert python == {"launch": 0, "launch_grad": 0}, python
    launches = standin.launches if standin else None
    monkeypatch.undo()  # (Triton's launch from Python, as on the CPU)
    monkeypatch.setattr(triton_kernel, "static_launch", lambda *args, **kwargs: None)
    want_losses, want, launched = _steps(dtype)
    assert losses == want_losses
    assert launched["launch"] > 0 and launched["launch_grad"] > 0
    assert launches is None or launches >= launched["launch"] + launched["launch_grad"]
    assert snap.layers.keys() == want.layers.keys()
    for name, layer in want.layers.items():
        assert layer.grad_out_rms is not None and layer.rms_max is not None
        assert snap.layers[name] == layer, name


def test_a_pointer_off_the_compiled_alignment_is_launched_by_triton(
        standin: StandIn | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel compiled for aligned pointers reads a misaligned one wrongly (or faults):
    a call whose input is not 16-byte aligned goes to Triton's launch, which compiles
    for it; the rest (the gradients, aligned) still go through the static launch; the
    statistics are Triton's launch's throughout."""
    losses, snap, python = _steps(torch.bfloat16, offset=True)
    assert python["launch"] > 0 and python["launch_grad"] == 0
    assert standin is None or standin.launches > 0
    monkeypatch.undo()
    monkeypatch.setattr(triton_kernel, "static_launch", lambda *args, **kwargs: None)
    want_losses, want, _ = _steps(torch.bfloat16, offset=True)
    assert losses == want_losses and snap.layers == want.layers


def test_a_static_launch_that_fails_gives_way_to_tritons_launch(
        standin: StandIn | None, monkeypatch: pytest.MonkeyPatch,
        recwarn: pytest.WarningsRecorder) -> None:
    """A launcher that refuses (a torch or a Triton unlike the ones this was written
    for) costs speed, nothing else: the lane launches by Triton from then on, with no
    warning, no layer disabled, and the statistics of Triton's launch."""
    if standin is None:
        pytest.skip("a refusing stand-in: the CPU's")

    def refuse(*args: Any) -> None:
        raise RuntimeError("refused")

    made = standin.spec
    monkeypatch.setattr(triton_kernel, "static_launch",
                        lambda *args, **kwargs: (refuse, *made(*args, **kwargs)[1:]))
    losses, snap, python = _steps(torch.float32)
    assert python["launch"] > 0 and python["launch_grad"] > 0
    assert not [w for w in recwarn if "normwatch" in str(w.message)], list(recwarn)
    monkeypatch.setattr(triton_kernel, "static_launch", lambda *args, **kwargs: None)
    want_losses, want, _ = _steps(torch.float32)
    assert losses == want_losses and snap.layers == want.layers


def test_there_is_no_static_launch_off_cuda() -> None:
    x = torch.randn(4, 8)  # (the CPU: Triton's interpreter; the lanes launch by Triton)
    assert static_launch(triton_kernel._kernel(), (x.dtype, x.dtype, torch.float32, 4, 8,
                                                   8, 1, 8, 1),
                         {"HAS_OUT": True, "FULL": True, "CENTRED": True, "BLOCK_D": 8,
                          "TOKENS": 1},
                         4, x.device) is None


def test_a_statically_launched_call_runs_no_python_of_normwatch(
        standin: StandIn | None) -> None:
    """#48 item 1, "no Python per call": with a static launch, a sentinel call of a launch
    lane runs none of normwatch's Python, its launch included (with Triton's launch from
    Python, ``lane_launch`` and ``launch`` a call: ``test_opcount.py``); what is left is
    the step's bookkeeping around the model's forward."""
    from torch import nn

    from tests.benchmarks import opcount

    model = nn.Sequential(nn.Linear(64, 64), nn.RMSNorm(64), nn.RMSNorm(64)).to(DEVICE)
    x = torch.randn(8, 64, requires_grad=True, device=DEVICE)
    with opcount.watched(model, kernel="triton") as hook:
        hook.rt.update(full_stats=False, check_outputs=False)
        model(x)  # the interval's first calls (their dtypes noted), the lender filled
        hook.rt.accumulator.buffers.give_back()
        before = standin.launches if standin else 0
        frames = opcount.frames_of(lambda: model(x))
        rows = [hook.rt.accumulator._staged[-k] for k in (1, 2)]
    assert frames == ["_forward_begins", "forward", "mark", "_forward_ends"], frames
    assert standin is None or standin.launches - before == 2
    assert sorted(r.row for r in rows) == [0, 1]
    with torch.no_grad():  # (read by the launch: each token's max |x| is its own)
        inputs = [model[0](x), model[1](model[0](x))]
    for r in rows:
        assert torch.equal(r.v[0], inputs[r.row].abs().amax(1)), r.row


class StepStandIn:
    """A stand-in for torch's static launcher behind the step's cross-layer launches
    (:class:`~normwatch.measure.backends.triton_launch.Launch`: the folds, the update
    monitor's sample, the guard's check) on the CPU: specs made by the module's own
    :func:`compiled_spec` as Triton specializes (an int of 1 a constant), launched by
    reading the arguments by their letters and running the kernel in the interpreter on
    the tensors the pointers name (noted as the launch takes their addresses)."""

    def __init__(self) -> None:
        self.launched: dict[str, int] = {}
        self.named: dict[int, torch.Tensor] = {}
        self.made = 0

    def address(self, t: torch.Tensor) -> int:
        self.named[t.data_ptr()] = t
        return t.data_ptr()

    def spec(self, kernel: Any, args: Any, constexprs: dict[str, Any], grid: int,
             device: torch.device, warps: int = 4) -> Any:
        names, values, _, compiled = jit_compiled(kernel, args, constexprs, warps)
        made = compiled_spec(compiled, values, grid)
        assert made is not None
        head, kept, places = made
        self.made += 1

        def launch(function: int, gx: int, gy: int, gz: int, num_warps: int, shared: int,
                   kinds: str, got: tuple[Any, ...], stream: int) -> None:
            assert (gy, gz, num_warps, kinds, stream) == (1, 1, warps, head[6], 0)
            assert len(got) == len(kinds) and None not in got
            positional = []
            for name, place in zip(names, places, strict=True):
                if name in constexprs:
                    continue
                value = values[name] if place < 0 else got[place]
                positional.append(self.named[value] if kinds[place:place + 1] == "O"
                                  else value)
            self.launched[kernel.__name__] = self.launched.get(kernel.__name__, 0) + 1
            kernel[(gx,)](*positional, **constexprs)

        return launch, head, kept, places[:len(args)], None


def _guarded_steps(made: Callable[[], int] = lambda: 0, steps: int = 4
                   ) -> tuple[list[float], Any, list[int]]:
    """A tiny Llama trained on the fused kernels' path with every cross-layer launch a
    step makes: the calls' fold and accumulate each step (the early warning's, as on
    CUDA), the gradients' fold (``stats_every=2``), the update monitor's sample and the
    guard's check; an inf planted in the last step's final norm (its step is read from
    the calls' score base, an argument new every step). Its losses, its interval's
    snapshot and ``made()`` after each step."""
    from normwatch.measure.step.early import EarlyWarning
    from tests.benchmarks.opcount import _Landed

    torch.manual_seed(0)
    model = tiny_llama(16, 1, vocab=64, heads=2, kv_heads=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = normwatch.watch(model, opt, report_dir=None, kernel="triton", stats_every=2,
                            flush_every=100, guard=True)
    watch._early = EarlyWarning(watch.config.limits.fp16_limit, _Landed, pin=False)
    tokens = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0))
    planted = [False]

    def plant(module: Any, args: tuple[torch.Tensor, ...]) -> Any:
        return (args[0].index_fill(-1, torch.tensor([3]), float("inf")),) if planted[0] \
            else None

    model.model.norm.register_forward_pre_hook(plant)
    losses, counts = [], []
    try:
        for step in range(steps):
            planted[0] = step == steps - 1
            losses.append(train_step(model, opt, tokens, watch).item())
            counts.append(made())
        snap = watch.flush() if watch.unflushed else watch.last_flush.snapshot
        assert not watch.disabled, watch.disabled
    finally:
        watch.close()
    return losses, snap, counts


def test_the_steps_cross_layer_launches_go_static_and_read_what_tritons_launch_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """#48 items 1-2: a step's cross-layer kernels (the calls' fold, the accumulate, the
    gradients' fold, the update monitor's sample, the guard's check) are launched by a
    static launch made once per specialization (the calls' score base changes every
    step: the launch does not), not by Triton's Python; the statistics, updates and
    losses are those of Triton's own launch, bit for bit."""
    from normwatch.measure.backends import triton_launch

    if not triton_kernel.usable() or DEVICE.type == "cuda":
        pytest.skip("the stand-in is the CPU's (on a GPU: gpu.py's ops part)")
    standin = StepStandIn()
    monkeypatch.setattr(triton_launch, "static_launch", standin.spec)
    monkeypatch.setattr(triton_launch, "address", standin.address)
    real = triton_launch.Launch.__call__
    python: list[str] = []

    def spied(self: Any, grid: int, *args: Any, **constexprs: Any) -> None:
        python.append(self.kernel().__name__)
        real(self, grid, *args, **constexprs)

    monkeypatch.setattr(triton_launch.Launch, "__call__", spied)
    for launch in _launches():
        launch.specs.clear()
    losses, snap, made = _guarded_steps(lambda: standin.made)
    launched = dict(standin.launched)
    assert set(launched) == {"fold_calls_kernel", "accumulate_kernel", "fold_grads_kernel",
                             "sample_kernel", "check_kernel", "row_stats_kernel",
                             "grad_rows_kernel"}, launched  # (the lanes': by lane_launch)
    assert sum(launched.values()) == len(python)  # (every one of them static)
    assert made[1] == made[-1], made  # (each tier's specs made once: none after step 2)
    monkeypatch.undo()
    for launch in _launches():
        launch.specs.clear()
    want_losses, want, _ = _guarded_steps()
    assert losses[:-1] == want_losses[:-1] and math.isnan(losses[-1] + want_losses[-1])
    assert snap.layers == want.layers and snap.updates == want.updates
    assert snap.first_nonfinite == want.first_nonfinite
    assert want.first_nonfinite is not None and want.first_nonfinite.step == 4
    assert all(s.grad_out_rms is not None and s.rms_max is not None
               for s in want.layers.values())


def _launches() -> list[Any]:
    from normwatch.measure.backends import triton_folds, triton_optimizer

    return [triton_folds._FOLD_CALLS, triton_folds._ACCUMULATE, triton_folds._FOLD_GRADS,
            triton_optimizer._SAMPLE, triton_optimizer._CHECK, triton_kernel._ROWS,
            triton_kernel._GRAD_ROWS]


def _compiled_steps(steps: int = 2, each: Any = None) -> Any:
    """A tiny Llama compiled (``aot_eager``: the graph's operators run as compiled code
    runs them), on the fused kernels' path, every step full-tier: its flush (``each``:
    called with each step's index once it is done)."""
    torch.compiler.reset()  # (the class's code compiled by another run: compiled anew)
    torch.manual_seed(0)
    model = tiny_llama(16, 1, vocab=64, heads=2, kv_heads=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = normwatch.watch(model, opt, report_dir=None, kernel="triton", stats_every=1,
                            flush_every=100, early_warning=False)
    run = torch.compile(model, backend="aot_eager")
    tokens = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0))
    try:
        for step in range(steps):
            train_step(run, opt, tokens, watch)
            if each is not None:
                each(step)
        snap = watch.flush()
        assert not watch.disabled, watch.disabled
    finally:
        watch.close()
    return snap


def test_a_compiled_calls_operator_launches_by_a_static_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.compile``, where a lane's plan has no static launch (here: the lanes'
    specs are the CPU's, none), a norm call's and a gradient's operator body reads by the
    fused kernels from Python: by a static launch too (:class:`Launch`), not by Triton's
    launch path; the statistics are those of Triton's own launch."""
    from normwatch.measure.backends import triton_launch

    if not triton_kernel.usable() or DEVICE.type == "cuda":
        pytest.skip("the stand-in is the CPU's (on a GPU: gpu.py's ops part)")
    standin = StepStandIn()
    monkeypatch.setattr(triton_launch, "static_launch", standin.spec)
    monkeypatch.setattr(triton_launch, "address", standin.address)
    for launch in _launches():
        launch.specs.clear()
    snap = _compiled_steps()
    assert standin.launched.get("row_stats_kernel", 0) >= 3 * 2, standin.launched
    assert standin.launched.get("grad_rows_kernel", 0) >= 3 * 2, standin.launched
    monkeypatch.undo()
    for launch in _launches():
        launch.specs.clear()
    want = _compiled_steps()
    assert snap.layers == want.layers
    assert all(s.grad_out_rms is not None and s.rms_max is not None
               for s in want.layers.values())


def test_a_compiled_models_calls_and_gradients_launch_from_cpp(
        standin: StandIn | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """#48/#49: compiled, a graph's operators' bodies are the C++ lanes': each norm call,
    each gradient site and each output gradient with the one through the norm (the
    formula's kernel, :func:`launch_through`) is one static launch from C++, with no
    launch from normwatch's Python after the first step (the interval's first calls,
    the Python hook's); the statistics are those of Triton's own launch, bit for bit."""
    names = ("launch", "launch_grad", "launch_through")
    python = dict.fromkeys(names, 0)
    real = {name: getattr(triton_kernel, name) for name in names}
    for name in names:
        monkeypatch.setattr(triton_kernel, name, lambda *a, _name=name, **k: (
            python.__setitem__(_name, python[_name] + 1), real[_name](*a, **k))[1])
    launches: list[dict[str, int]] = []
    snap = _compiled_steps(3, each=lambda step: (launches.append(
        dict(standin.launched) if standin else {}), step == 0 and python.update(
            dict.fromkeys(names, 0))))
    assert python == dict.fromkeys(names, 0), python
    if standin is not None:  # 3 norms a step, 2 steps: their calls, hidden states, outputs
        after = {k: v - launches[0].get(k, 0) for k, v in launches[-1].items()}
        assert after == {"row_stats_kernel": 6, "grad_rows_kernel": 6,
                         "through_rows_kernel": 6}, after
    monkeypatch.setattr(triton_kernel, "static_launch", lambda *args, **kwargs: None)
    want = _compiled_steps(3)
    assert python["launch_through"] > 0  # (Triton's launch: through_rows')
    assert snap.layers == want.layers
    assert all(s.grad_in_rms is not None and s.grad_out_rms is not None
               for s in want.layers.values())

