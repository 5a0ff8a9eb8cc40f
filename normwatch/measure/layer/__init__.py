"""A norm layer's ways in: its recorder (:mod:`~normwatch.measure.layer.recorder`, the one
body that decides whether a call counts, what it records and where it stages), the eager
hooks that call it (:mod:`~normwatch.measure.layer.hooks`), what ``torch.compile`` traces
(:mod:`~normwatch.measure.layer.compiled`) and the operators compiled graphs call
(:mod:`~normwatch.measure.layer.operators`), the gradient hooks
(:mod:`~normwatch.measure.layer.gradients`), the output check
(:mod:`~normwatch.measure.layer.outputs`); reading a call's arguments and dtypes
(:mod:`~normwatch.measure.layer.calls`, :mod:`~normwatch.measure.layer.autocasting`),
``torch.compile``'s settings the watch needs (:mod:`~normwatch.measure.layer.compiling`),
and what a pickled model keeps of the hooks (:mod:`~normwatch.measure.layer.unwatched`).
"""
