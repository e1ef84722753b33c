"""Imports between the layers. The core (``mos_lease``) imports no adapter package and no
driver: it must run where psycopg and OpenTelemetry are absent, and an adapter depends on the
core, never the other way round. ``mos_lease.otel`` is the one core module that needs an
extra (OpenTelemetry, which it exists to speak to); it is imported only by whoever wants it.
The PostgreSQL adapter's administration stays out of what a gateway imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mos_lease

CORE = Path(mos_lease.__file__).resolve().parent
ADAPTERS = ("mos_lease_memory", "mos_lease_pg", "mos_lease_tmux")
DRIVERS = ("psycopg", "psycopg_pool", "psycopg_c", "psycopg_binary")
EXTRA_ONLY = {"otel.py": ("opentelemetry",)}  # the module written for that extra


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)


def _imported_roots(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement of ``path`` names, those inside functions included
    (a lazy import is still a dependency), as (line, top-level package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_no_core_module_names_an_adapter_or_a_driver() -> None:
    forbidden = (*ADAPTERS, *DRIVERS, "opentelemetry")
    found = []
    for path in sorted(CORE.rglob("*.py")):
        allowed = EXTRA_ONLY.get(str(path.relative_to(CORE)), ())
        found += [f"{path.relative_to(CORE)}:{line} {root}"
                  for line, root in _imported_roots(path)
                  if root in forbidden and root not in allowed]
    assert found == []


def test_importing_the_core_loads_no_adapter_driver_or_telemetry_sdk() -> None:
    """Every ``mos_lease`` module but ``mos_lease.otel`` imported, in a fresh interpreter:
    nothing outside the core and its declared dependency is loaded."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import mos_lease\n"
        "for info in pkgutil.walk_packages(mos_lease.__path__, 'mos_lease.'):\n"
        "    if info.name != 'mos_lease.otel':\n"
        "        importlib.import_module(info.name)\n"
        f"roots = {(*ADAPTERS, *DRIVERS, 'opentelemetry')!r}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in roots)\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    done = _run(code)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_memory_adapter_at_work_loads_no_other_adapter_or_driver() -> None:
    """The in-memory adapter's modules imported, a coordinator on its store and the demo
    run: neither PostgreSQL nor OpenTelemetry is loaded."""
    code = (
        "import contextlib, importlib, io, pkgutil, sys\n"
        "import mos_lease_memory\n"
        "for info in pkgutil.walk_packages(mos_lease_memory.__path__, 'mos_lease_memory.'):\n"
        "    importlib.import_module(info.name)\n"
        "from mos_lease import ConnectorLeaseCoordinator\n"
        "from mos_lease_memory import InMemoryLeaseStore\n"
        "from mos_lease_memory.demo import run\n"
        "assert ConnectorLeaseCoordinator(InMemoryLeaseStore()).store.leases() == []\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert run() == 0\n"
        f"roots = {('mos_lease_pg', 'mos_lease_tmux', *DRIVERS, 'opentelemetry')!r}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in roots)\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    done = _run(code)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_coordinator_is_given_its_store() -> None:
    """The core has no default store to fall back on: which adapter holds the leases is the
    application's choice, made where it builds its coordinator."""
    from mos_lease import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator

    for coordinator in (ConnectorLeaseCoordinator, AsyncConnectorLeaseCoordinator):
        try:
            coordinator()  # type: ignore[call-arg]
        except TypeError as missing:
            assert "store" in str(missing)
        else:
            raise AssertionError(f"{coordinator.__name__}() built a store of its own")


def test_without_psycopg_importing_the_postgresql_adapter_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['psycopg'] = None\n"
        "from mos_lease.errors import MissingExtra\n"
        "try:\n"
        "    import mos_lease_pg\n"
        "except MissingExtra as missing:\n"
        "    print(missing)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n")
    done = _run(code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pip install 'mos-lease[pg]'" in done.stdout
