"""Sending it out: the Prometheus collector, cross-rank combining, logger metrics."""
