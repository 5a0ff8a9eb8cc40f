"""Framework adapters, installed as ``normwatch.integrations``.

Each adapter imports its framework lazily, inside its own module, so that
``import normwatch`` never pulls in Lightning or transformers.
"""
