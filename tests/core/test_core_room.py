"""``tests/core`` holds the pure core's tests: no module under it, and no support module of
``tests/`` that it imports, imports psycopg or OpenTelemetry or a package that does (the
PostgreSQL adapter, the OpenTelemetry hook), at the top of a module or inside a function.
So ``pip install -e . pytest hypothesis`` and then ``pytest tests/core`` passes: ``.ci/run``
does exactly that in a throwaway environment; this test keeps the room honest statically,
on a machine where the extras are installed and an import would go unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent
ROOT = CORE.parents[1]
# Packages the room may not import, and their submodules.
FORBIDDEN = ("psycopg", "psycopg_pool", "psycopg_c", "psycopg_binary", "opentelemetry",
             "mos_lease_pg", "mos_lease.otel")


def imported(source: str) -> set[str]:
    """Every absolute module name ``source`` imports anywhere in it; ``from a import b``
    counts as ``a`` and ``a.b``, since ``b`` may be a module (``from mos_lease import
    otel``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def forbidden(names: set[str]) -> list[str]:
    return sorted(name for name in names
                  if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN))


def room_and_support() -> dict[Path, set[str]]:
    """The modules of ``tests/core`` and, transitively, the ``tests`` modules they import,
    each with what it imports."""
    found: dict[Path, set[str]] = {}
    todo = sorted(CORE.rglob("*.py"))
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found[path] = imported(path.read_text())
        for name in found[path]:
            module = ROOT / (name.replace(".", "/") + ".py")
            if name.startswith("tests.") and module.is_file():
                todo.append(module)
    return found


def test_the_core_room_imports_neither_psycopg_nor_opentelemetry() -> None:
    modules = room_and_support()
    assert CORE / "test_machine.py" in modules and ROOT / "tests" / "helpers.py" in modules
    offenders = {str(path.relative_to(ROOT)): bad for path, names in modules.items()
                 if (bad := forbidden(names))}
    assert offenders == {}


@pytest.mark.parametrize("source", [
    "import psycopg\n",
    "def f():\n    from opentelemetry.sdk.trace import TracerProvider\n",
    "from mos_lease import otel\n",
    "class C:\n    def m(self):\n        import mos_lease_pg.store as s\n",
])
def test_the_scan_finds_an_import_wherever_it_hides(source: str) -> None:
    assert forbidden(imported(source))


def test_the_scan_lets_the_core_through() -> None:
    source = "import mos_lease\nfrom mos_lease.machine import Renew\nimport hypothesis\n"
    assert forbidden(imported(source)) == []
