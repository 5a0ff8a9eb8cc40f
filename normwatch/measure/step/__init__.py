"""What a step leaves beside the norms' rows: its loss, copied at the flush
(:mod:`~normwatch.measure.step.losses`), its batch fingerprint and RNG states for a
replay (:mod:`~normwatch.measure.step.replay`), and the early warning's peek at the
state one step late (:mod:`~normwatch.measure.step.early`).
"""
