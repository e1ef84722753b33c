"""Imports between the layers: the core never imports the PostgreSQL driver (it must run
where psycopg is absent), and it imports no sibling package at all, the in-memory store
included; that store keeps its former import paths."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mos_lease
import mos_lease_memory
import mos_lease_memory.clock
import mos_lease_memory.fencing
import mos_lease_memory.store
from mos_lease import clock, memory, ports

CORE = Path(mos_lease.__file__).resolve().parent


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)


def test_core_and_memory_store_do_not_import_psycopg() -> None:
    code = ("import sys, mos_lease, mos_lease.testing, mos_lease_memory, mos_lease.keeper, "
            "mos_lease.token, mos_lease.fencing, mos_lease.adapter, mos_lease.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('psycopg', 'psycopg_pool', 'mos_lease_pg')); print(bad); "
            "sys.exit(1 if bad else 0)")
    done = _run(code)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_core_module_names_the_memory_package() -> None:
    """Every import statement in ``mos_lease``, those inside functions included (the
    coordinators build their default store lazily), is read from the source."""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(CORE)}:{node.lineno} {name}" for name in names
                      if name.split(".")[0] == "mos_lease_memory"]
    assert found == []


def test_the_core_at_work_loads_no_sibling_package() -> None:
    """Every ``mos_lease`` module imported, both coordinators built with their default
    store and the demo run: no ``mos_lease_*`` package is loaded."""
    code = (
        "import contextlib, importlib, importlib.util, io, pkgutil, sys\n"
        "import mos_lease\n"
        "for info in pkgutil.walk_packages(mos_lease.__path__, 'mos_lease.'):\n"
        # The otel extra's module needs that extra; tests/core runs without it (.ci/run).
        "    if info.name == 'mos_lease.otel' and not importlib.util.find_spec('opentelemetry'):\n"
        "        continue\n"
        "    importlib.import_module(info.name)\n"
        "from mos_lease import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator\n"
        "from mos_lease.demo import run\n"
        "assert ConnectorLeaseCoordinator().store.leases() == []\n"
        "assert AsyncConnectorLeaseCoordinator().store.sync.leases() == []\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert run() == 0\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0].startswith('mos_lease_'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    done = _run(code)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_memory_store_keeps_its_former_import_paths() -> None:
    assert mos_lease_memory.InMemoryLeaseStore is memory.InMemoryLeaseStore
    assert mos_lease_memory.AsyncInMemoryLeaseStore is memory.AsyncInMemoryLeaseStore
    assert mos_lease_memory.ManualClock is clock.ManualClock
    assert mos_lease_memory.SystemClock is clock.SystemClock
    assert mos_lease_memory.store.InMemoryLeaseStore is memory.InMemoryLeaseStore
    assert mos_lease_memory.store.AsyncInMemoryLeaseStore is memory.AsyncInMemoryLeaseStore
    assert mos_lease_memory.store.MAX_AUDIT_PAGE == ports.MAX_AUDIT_PAGE
    assert mos_lease_memory.store.Clock is clock.Clock
    assert mos_lease_memory.clock.ManualClock is clock.ManualClock
    assert mos_lease_memory.clock.SystemClock is clock.SystemClock
    assert callable(mos_lease_memory.fencing.InMemoryResourceGuard)
    store = mos_lease_memory.InMemoryLeaseStore(mos_lease_memory.ManualClock())
    assert isinstance(store, memory.InMemoryLeaseStore) and store.leases() == []
