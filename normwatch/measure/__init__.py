"""Measurement, the hot path: discovery, hooks, reductions, the Triton kernel, the
accumulator, early warnings, the reference formulas and the fp16 probe.

Nothing here synchronises with the host except :meth:`Measurement.read` (the flush).
"""
