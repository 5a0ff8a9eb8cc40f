"""Measurement, the hot path: what a norm call, its gradients and the optimizer's step
record, on the activations' device, with no host synchronisation until the flush
(:meth:`~normwatch.measure.measurement.Measurement.read`). ``docs/inside/hot-path.md`` follows
one call from the hook to the snapshot.

The rooms, in the order their imports flow:

- :mod:`~normwatch.measure.state`: what is recorded: a call's and a gradient's rows, the
  folds, the accumulator, the lender, and the backend protocol (the seam);
- :mod:`~normwatch.measure.backends`: how it is computed, per device (torch's ops, the
  fused Triton kernel, the CPU's native C and C++), chosen in one place;
- :mod:`~normwatch.measure.model`: the model side: discovery, reference formulas, the
  fp16 probe, isolation, FSDP2's shards;
- :mod:`~normwatch.measure.step`: what a step leaves beside the rows: losses, the replay
  log, the early-warning peek;
- :mod:`~normwatch.measure.optimizer`: the optimizer side: update norms, the guard, the
  loop's ``clip_grad_norm_``;
- :mod:`~normwatch.measure.layer`: a layer's ways in: the one recorder, the eager hooks,
  the compiled path and its operators, the gradient hooks, the output check;
- :mod:`~normwatch.measure.measurement`: one model's measurement, over all of them.
"""
