"""Every public name has a docstring, so the API reference (generated from the docstrings
by mkdocstrings, ``docs/reference/``) documents all of it: each name in the public packages'
``__all__``, and each public method and property those classes define."""

from __future__ import annotations

import enum
import importlib
import inspect
from pathlib import Path

import pytest

PUBLIC = ("mos_lease", "mos_lease_pg", "mos_lease_pg.admin", "mos_lease_memory",
          "mos_lease.testing")
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"


def _undocumented(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [  # else what the module itself defines
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
