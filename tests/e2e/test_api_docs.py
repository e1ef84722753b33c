"""Every public name has a docstring, so the API reference (generated from the docstrings
by mkdocstrings, ``docs/reference/``) documents all of it: each name in the public packages'
``__all__``, each name the reference renders from a submodule (the core's top level is kept
small; the rest is imported from the module named for what it holds), and each public
method and property those classes define."""

from __future__ import annotations

import enum
import importlib
import inspect
import re
from pathlib import Path

import pytest

PUBLIC = ("mos_lease", "mos_lease_pg", "mos_lease_pg.admin", "mos_lease_memory",
          "mos_lease.testing")
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"


# A block of a reference page: ``::: module``, then its options, perhaps a ``members`` list.
_BLOCK = re.compile(r"^::: (\S+)\n((?:    .*\n|\s*\n)*)", re.M)


def _rendered(page: str = "*.md") -> dict[str, list[str] | None]:
    """Each module the reference renders, with the members it lists (``None``: all)."""
    pages = "\n".join(path.read_text() for path in sorted(REFERENCE.glob(page)))
    return {match[1]: re.findall(r"^        - (\w+)$", match[2], re.M) or None
            for match in _BLOCK.finditer(pages + "\n")}


def _undocumented(module_name: str, names: list[str] | None = None) -> list[str]:
    module = importlib.import_module(module_name)
    names = names or getattr(module, "__all__", None) or [  # else what the module defines
        name for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module_name]
    missing = []
    for name in names:
        value = getattr(module, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if not (value.__doc__ or "").strip():
            missing.append(name)
        if not inspect.isclass(value) or issubclass(value, enum.Enum):
            continue
        for attribute, raw in vars(value).items():
            if attribute.startswith("_"):
                continue
            member = (raw.__func__ if isinstance(raw, classmethod | staticmethod)
                      else raw.fget if isinstance(raw, property) else raw)
            if inspect.isfunction(member) and not (member.__doc__ or "").strip():
                missing.append(f"{name}.{attribute}")
    return missing


@pytest.mark.parametrize("module_name", PUBLIC)
def test_every_public_name_has_a_docstring(module_name: str) -> None:
    assert _undocumented(module_name) == []


@pytest.mark.parametrize("module_name", PUBLIC)
def test_the_reference_renders_the_module(module_name: str) -> None:
    pages = "\n".join(page.read_text() for page in REFERENCE.glob("*.md"))
    assert f"::: {module_name}\n" in pages


@pytest.mark.parametrize("module_name", sorted(_rendered("mos_lease.md")))
def test_every_name_the_core_reference_renders_has_a_docstring(module_name: str) -> None:
    members = _rendered("mos_lease.md")[module_name]
    module = importlib.import_module(module_name)
    assert [name for name in members or [] if not hasattr(module, name)] == []
    assert _undocumented(module_name, members) == []


def test_the_core_top_level_is_what_a_gateway_author_uses() -> None:
    """About 35 names; a store's contract, records, events and the like are imported from
    their submodules, each of which the reference renders."""
    import mos_lease

    assert len(mos_lease.__all__) <= 40  # with hold()'s two option groups and the supervisors
    rendered = _rendered()
    for module in ("mos_lease.ports", "mos_lease.records", "mos_lease.events",
                   "mos_lease.identity", "mos_lease.fencing", "mos_lease.clock"):
        assert module in rendered, module
