"""What is recorded, whatever computes it: a call's and a gradient's per-token rows
(:mod:`~normwatch.measure.state.rows`), the buffers lent for them
(:mod:`~normwatch.measure.state.buffers`), their folds into one line per call and per
gradient (:mod:`~normwatch.measure.state.fold`, :mod:`~normwatch.measure.state.grad_fold`:
torch's ops), the per-layer state on each device (:mod:`~normwatch.measure.state.
accumulator`), and the protocol every backend implements
(:mod:`~normwatch.measure.state.backend`: the seam).
"""
