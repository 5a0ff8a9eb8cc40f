"""Judgement: alarm rules, the fp16 headroom forecast, loss spikes, blame, history.

Pure functions and small state over host-side records (:mod:`normwatch.records`); no torch.
"""
