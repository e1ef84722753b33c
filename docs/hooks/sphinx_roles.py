"""A griffe extension for the API reference: the docstrings cross-reference in reST roles
(``:class:`~mos_lease.LeaseStore```), which Markdown would show raw. Each role becomes
inline code of the name it shows (the last part after ``~``)."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|exc|obj):`(~?)([^`]+)`")


def _shown(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(Extension):
    """Rewrite reST roles in every docstring griffe loads."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_shown, obj.docstring.value)
