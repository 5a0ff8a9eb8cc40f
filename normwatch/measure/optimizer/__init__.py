"""The optimizer side: gradient and update norms from the optimizer's step hooks
(:mod:`~normwatch.measure.optimizer.updates`), the guard that keeps a poisoned step from
the weights (:mod:`~normwatch.measure.optimizer.guard`), and the norm the loop's
``clip_grad_norm_`` already computed (:mod:`~normwatch.measure.optimizer.clipping`).
"""
