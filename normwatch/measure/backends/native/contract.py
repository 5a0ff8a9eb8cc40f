"""The native lanes' contract with Python, stated once: every attribute the C++ reads or
writes, by role, and what it does with it. The module hands :data:`NAMES` to the C++ at
setup (:func:`~normwatch.measure.backends.native.lane.module`); no attribute name is
written in the C++ sources. A test checks every name against real objects
(``tests/measure/backends/test_contract.py``).

What the lanes run, and where the Python they stand for is:

- **The forward lane** (``lane.cpp``, bound to a layer's
  :class:`~normwatch.measure.layer.hooks.LayerHook`): a call of the common CPU case (the
  input the first positional argument, a plain contiguous tensor whose last dim is one
  token, the output laid out alike, a training call with grad outside a backward, not
  the interval's output check, the watch not paused) is what
  :meth:`Recorder.record <normwatch.measure.layer.recorder.Recorder.record>` does with
  the native backend: the same C read (``normwatch_rows_planned``, planned by
  :func:`~normwatch.measure.backends.native.readers.row_plan`), into a buffer from the
  accumulator's lender, the same :class:`~normwatch.measure.state.rows.CallRows` staged,
  the same counts. Then on the interval's first call, and a full-tier call that is not
  the common full-tier case, it calls the layer's ``_tail``
  (:meth:`Recorder.after <normwatch.measure.layer.recorder.Recorder.after>`); the common
  full-tier case (``full_tail``: its only argument a float32 input with an autograd node,
  the gradient through the norm computed, the weight already hooked) it hooks as
  :meth:`GradHooks.watch_call <normwatch.measure.layer.gradients.GradHooks.watch_call>`
  does, and calls the recorder's ``record_dtypes`` where the dtypes changed. Every other
  call goes to the layer's Python hook.
  A *launch lane* (a layer whose backend has a launcher,
  :meth:`Backend.launcher <normwatch.measure.state.backend.Backend.launcher>`: the Triton
  backend's, on CUDA or in Triton's interpreter) records the same calls the same way,
  planning with the launcher's ``lane_plan`` and reading with one launch into the lent
  buffer (on the lender's device key): the plan's static launch
  (:mod:`~normwatch.measure.backends.triton_launch`), called from here with the call's
  pointers and its device's current stream, else the launcher's ``lane_launch``; and
  hands every full-tier call's rest to ``_tail``.
- **The compiled lane** (``lane.cpp``'s ``observe`` and ``observe_grad``, bound to a
  layer's :class:`~normwatch.measure.layer.compiled.CompiledPath` as its ``call`` and
  ``grad``: the bodies of the operators a compiled graph calls). A call of the same
  common case is read and staged the same way, its training and grad mode decided where
  it was traced (inside a backward it counts nothing, as ``compiled_call``); then on the
  layer's first call the recorder's ``after``, else its ``record_dtypes`` where the
  dtypes changed. Every other call goes to the path's ``compiled_call``. A gradient on a
  step whose backward is not measured does nothing; on a measured step the layer's C++
  gradient hooks read its plain case (a site's, the weight's, the output's with the one
  through the norm: by the C kernel, a launch lane's by one launch its launcher's
  ``lane_through_plan`` planned) as ``GradHooks.measure`` does; every other goes to
  ``compiled_grad``.
- **The gradient hooks** (``grads.cpp``, their reads ``gradreads.cpp``; one capsule per
  layer's :class:`~normwatch.measure.layer.gradients.GradHooks`): a gradient of the plain case is
  read by the C reader its site's plan names and staged as ``GradHooks._measure`` stages
  it; a launch lane's site planned by its launcher's ``lane_grad_plan`` and read by one
  launch (the plan's static launch, without or with a second part, else
  ``lane_grad_launch``), its weight's norm by torch's op; every other case calls the GradHooks
  method it stands for.
- **The step hooks** (``sampler.cpp``): an optimizer whose samples are all
  :class:`~normwatch.measure.backends.native.sampler.NativePack` is sampled as
  :class:`~normwatch.measure.optimizer.updates.UpdateMonitor`'s hooks do.

Lending and staging are the data structures' own: a lender
(:class:`~normwatch.measure.state.buffers.RowBuffers`) lends the last free buffer of a
shape, noting it lent, else its ``take`` is called; the accumulator's queue gets the rows
appended, its token count the rows' tokens, and past its cap its ``commit`` is called.
An error anywhere disables the layer as the Python hook's would (its ``_fail``).
"""

from __future__ import annotations

NAMES: dict[str, str] = {
    # the runtime (normwatch.measure.layer.recorder.Runtime): read, and the call counted
    "paused": "paused",
    "full_stats": "full_stats",
    "check_outputs": "check_outputs",
    "gradients": "gradients",
    "step": "step",
    "calls_this_step": "calls_this_step",  # + 1
    "accumulator": "accumulator",
    # a layer's host counts (normwatch.measure.layer.recorder.HostCounts)
    "calls": "calls",  # + 1
    "tokens": "tokens",  # + the call's tokens
    "input_shape": "input_shape",  # set
    "output_checked": "output_checked",
    # the module
    "training": "training",
    "weight": "weight",
    # the accumulator (normwatch.measure.state.accumulator.Accumulator)
    "staged_calls": "_staged",  # a call's rows appended
    "staged_grads": "_staged_grads",  # a gradient's rows appended
    "staged_tokens": "_staged_tokens",  # + their tokens
    "max_staged": "max_staged_tokens",
    "commit": "commit",  # called past the cap
    # a lender (normwatch.measure.state.buffers.RowBuffers)
    "free": "_free",  # shape -> free buffers: the last one lent
    "lent": "_lent",  # the buffer appended
    "take": "take",  # called where none is free
    # the layer's hook (normwatch.measure.layer.hooks.LayerHook)
    "lane_state": "_lane_state",  # its lane.State (None: a copy's)
    "capsule": "capsule",
    "tail": "_tail",  # (module, args, kwargs, output, full): the rest of a call
    "fail": "_fail",  # (exception): the layer disabled (the compiled path's too)
    "recorder": "recorder",
    # its compiled path (normwatch.measure.layer.compiled.CompiledPath): lane_state, fail
    "python_call": "compiled_call",  # (x, y, alone): a compiled call, Python's
    "python_grad": "compiled_grad",  # (site, g, x, weight): a compiled gradient, Python's
    # its recorder (normwatch.measure.layer.recorder.Recorder)
    "grads": "grads",
    "module": "module",
    "signature": "_signature",  # the dtypes last noted
    "record_dtypes": "record_dtypes",  # (module, x, y)
    "after": "after",  # (module, x, y, None): a compiled call's first call's rest
    # its gradient hooks (normwatch.measure.layer.gradients.GradHooks)
    "computed": "_computed",  # whether the gradient through the norm is computed
    "hooked_weight": "_weight",  # the weight hooked
    "grad_lane": "_lane",  # its lane.GradLane
    "node": "_node",  # (site, k, grads): a node's pre-hook, Python's
    "both": "_both",  # (k, [x, weight, version], grads): the output's, with through
    "weight_grad": "_weight_grad",  # (g): the weight's
    "through": "_in",  # (parts): the gradient through the norm, Python's
    "gather": "_gather",  # (count): a gatherer of its parts, for compiled autograd
    # a NativePack (normwatch.measure.backends.native.sampler)
    "pack_kind": "_kind",
    "pack_kept": "kept",
    "pack_split": "_split",
    "pack_blocks": "_blocks",
    "pack_width": "_width",
    "pack_stride": "_stride",
    "pack_scale": "_scale",
    "pack_params": "_params",
}
"""Role -> attribute name, for every attribute the C++ reads, writes or calls."""

ROWS_FIELDS = ("row", "key", "width", "eps", "v", "n", "lined_up", "full", "centred", "out")
""":class:`~normwatch.measure.state.rows.CallRows`' fields, in the order the lane fills
them."""
GRAD_ROWS_FIELDS = ("norms", "lo", "hi", "layer", "site", "width")
""":class:`~normwatch.measure.state.rows.GradRows`' fields, in the order the gradient
hooks fill them."""
SITES = {"grad_out": 0, "grad_in": 1, "grad_hidden": 2, "weight": 3}
"""The gradient sites' indices, as the gradient hooks name them."""

MAX_NODES = 64
"""How many autograd nodes the walk from a norm's output to its input takes before it
gives up (a norm with another input whose graph leads back into the model): Python's
(:func:`~normwatch.measure.layer.gradients.through_nodes`) and the C++ lane's."""
