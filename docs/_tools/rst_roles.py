"""Griffe extension: normwatch's docstrings (reST roles, double backticks, ``::``) read as
Markdown in the API reference, without rewriting the docstrings themselves."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


def as_markdown(text: str) -> str:
    """``:class:`~normwatch.Watch``` reads `Watch`; ````x```` reads `x`; ``::`` reads ``:``."""
    text = ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    text = text.replace("``", "`")
    return re.sub(r"::$", ":", text, flags=re.M)


class RstRoles(Extension):
    """Rewrites each object's docstring as it is loaded."""

    def on_instance(self, *, node: Any, obj: Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = as_markdown(obj.docstring.value)
