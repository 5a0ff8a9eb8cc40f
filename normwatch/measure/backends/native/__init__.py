"""The native backend (CPU): C readers and folds (``native_rows.c``, loaded with ctypes),
the C++ lanes that measure a layer's common calls and gradients with no Python frame
(``lane.cpp``) and the optimizer's step hooks (``sampler.cpp``), built at first use
(:mod:`~normwatch.measure.backends.native.build`).

- :mod:`~normwatch.measure.backends.native.backend`: the backend the seam calls;
- :mod:`~normwatch.measure.backends.native.readers`: a call, a gradient, the gradient
  through a norm, each in one pass, into lent buffers;
- :mod:`~normwatch.measure.backends.native.folds`: the step's folds in one call each;
- :mod:`~normwatch.measure.backends.native.sampler`: the update monitor's sample;
- :mod:`~normwatch.measure.backends.native.lane`: the C++ lanes' Python side, and
  :mod:`~normwatch.measure.backends.native.contract`: what they read and write of Python's.
"""
