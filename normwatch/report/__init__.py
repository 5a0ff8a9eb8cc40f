"""Saying it: alarm dispatch, post-mortems, the JSON document, HTML and the console."""
