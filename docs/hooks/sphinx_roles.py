"""A griffe extension for the API reference: the docstrings cross-reference in reST roles
(``:class:`~mos_lease.ports.LeaseStore```), which Markdown would show raw. Each role becomes
an autorefs cross-reference to the object's full path (in effect
``[`LeaseStore`][mos_lease.ports.LeaseStore]``), so it links to the object's entry in the
reference. A name relative to the docstring's own class or module (``:meth:`renew```,
``:mod:`.rows```) is looked up from there outwards, as Python would, and written as the full
path it finds.

* A role naming an object of these packages links to it: every module it names is in the
  reference (the internal ones on their own page), so a role whose object the site does not
  document is reported as well.
* A role naming the standard library's objects (``asyncio.Event``) is inline code.
* A role naming nothing stays a plain reference, which autorefs reports and
  ``mkdocs build --strict`` turns into a failure: the references stay checked.

The rewrite runs once per loaded package, over the package module itself and every object
defined in it: griffe's per-object events skip the package module, whose docstring would
otherwise keep its roles."""

from __future__ import annotations

import html
import importlib
import re
from collections.abc import Iterator
from typing import Any

from griffe import (
    Alias,
    AliasResolutionError,
    CyclicAliasError,
    Extension,
    GriffeLoader,
    Module,
    NameResolutionError,
    Object,
)

# The packages the site documents: a name of theirs can link to its entry in the reference.
PACKAGES = frozenset({"mos_lease", "mos_lease_pg", "mos_lease_memory", "mos_lease_tmux"})

# The Python-domain roles the docstrings use; ``:py:class:`` spells the same as ``:class:``.
ROLE = re.compile(
    r":(?:py:)?(?:class|meth|func|attr|data|const|mod|exc|obj):`(?P<short>~?)(?P<target>[^`]+)`")


def objects(root: Object) -> Iterator[Object]:
    """``root`` and every object defined under it (imported names, aliases, are skipped: their
    docstrings are their targets', rewritten where those are defined)."""
    yield root
    for member in root.members.values():
        if not isinstance(member, Alias):
            yield from objects(member)


def _found(path: str, loader: GriffeLoader) -> str | None:
    """Where the object ``path`` names is defined, if a loaded package holds it."""
    try:
        found = loader.modules_collection[path]
        return str(found.final_target.path if found.is_alias else found.path)
    except (KeyError, ValueError, AliasResolutionError, CyclicAliasError):
        return None


def _importable(path: str) -> bool:
    """Whether ``path`` names a module, or an attribute of one, that Python can import: the
    check for a package griffe has not loaded yet (the pages load them one at a time)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if name in getattr(value, "__annotations__", {}):
                return True  # a field declared in the class body, without a class attribute
            try:
                value = getattr(value, name)
            except AttributeError:
                return False
        return True
    return False


def _in_scope(first: str, scope: Object) -> str | None:
    """The full path of the name ``first`` seen from ``scope``: a member of it or of a class or
    module around it (inherited members included), or a name it imports."""
    level: Object | None = scope
    while level is not None:
        members = level.all_members if level.is_class else level.members
        if first in members:
            member = members[first]
            return member.target_path if isinstance(member, Alias) else member.path
        level = level.parent
    try:
        return str(scope.resolve(first))
    except NameResolutionError:
        return None


def target(written: str, scope: Object, loader: GriffeLoader) -> tuple[str, bool]:
    """The full path of the object a role in ``scope``'s docstring names, and whether that
    object exists: ``written`` as a full path if it is one, else its first part looked up
    from ``scope`` outwards, as Python's name lookup (and Sphinx's) would; a leading ``.`` only
    says the name is relative."""
    name = written.lstrip(".")
    candidates = [name] if name == written else []
    first, dot, rest = name.partition(".")
    if (base := _in_scope(first, scope)) is not None:
        candidates.append(base + dot + rest)
    for path in candidates:
        if (defined := _found(path, loader)) is not None:
            return defined, True
        if _importable(path):
            return path, True
    return name, False


def rewrite(text: str, scope: Object, loader: GriffeLoader) -> str:
    """``text`` with each role replaced by a cross-reference to its target's full path."""

    def link(match: re.Match[str]) -> str:
        written = match["target"]
        path, exists = target(written, scope, loader)
        shown = html.escape(written.rsplit(".", 1)[-1] if match["short"] else written.lstrip("."))
        if not exists:
            # Names nothing: autorefs reports it, which fails the strict build.
            return f"[`{shown}`][{path}]"
        if path.split(".", 1)[0] not in PACKAGES:
            return f"`{shown}`"  # the standard library's and others' names: no page to link
        # Required: the site documents every object of these packages a docstring names, so
        # a role whose object has no entry (a member a page's list leaves out) fails the
        # strict build too, and every cross-reference stays a link.
        return f'<autoref identifier="{path}"><code>{shown}</code></autoref>'

    return ROLE.sub(link, text)


class SphinxRoles(Extension):
    """Rewrite the reST roles of every docstring in each package griffe loads."""

    def on_package(self, *, pkg: Module, loader: GriffeLoader, **kwargs: Any) -> None:
        for obj in objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, obj, loader)
