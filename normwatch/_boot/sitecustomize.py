"""Started by ``normwatch run``: its folder goes first on the script's ``PYTHONPATH``, so
Python imports this at start-up; it chains to the ``sitecustomize`` it shadows, then
watches the script (:func:`normwatch.integrations.script.start_from_env`) — never failing it."""

import contextlib
import importlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
_SELF = sys.modules.pop("sitecustomize", None)
with contextlib.suppress(ImportError):
    importlib.import_module("sitecustomize")
if _SELF is not None:  # none shadowed: the import system expects this module back
    sys.modules.setdefault("sitecustomize", _SELF)
if os.environ.get("NORMWATCH_RUN") == "1":
    try:
        importlib.import_module("normwatch.integrations.script").start_from_env()
    except Exception as exc:  # the script runs unwatched rather than not at all
        print(f"normwatch run: not watching this process: {type(exc).__name__}: {exc}",
              file=sys.stderr)
