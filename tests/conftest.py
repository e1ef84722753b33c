"""What every room of the suite shares: the ``--soak`` option, the PostgreSQL fixtures where
the ``pg`` extra is installed, and the rule that CI fails on a skip.

The rooms are laid out like the code (docs/testing.md): ``core`` (the pure core, which
imports neither psycopg nor OpenTelemetry), ``pg``, ``conformance``, ``e2e``, ``otel``,
``faults`` and ``failover``. This file imports no psycopg, so that ``tests/core`` runs where
only ``pip install -e . pytest hypothesis`` was done. There the rooms that need an extra are
not collected and the report header says so; with ``MOS_LEASE_REQUIRE_PG=1`` (CI) they are
collected anyway, so that a missing extra fails the run instead of shrinking it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.tools import require_pg


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a submodule of a package that is not installed
        return False


HERE = Path(__file__).resolve().parent
# The modules each room needs beyond the core's own dependencies, and the extra that
# brings them.
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "pg": (("psycopg",), "pg"),
    "conformance": (("psycopg", "hypothesis"), "pg,testing"),
    "e2e": (("psycopg",), "pg"),
    "faults": (("psycopg",), "pg"),
    "failover": (("psycopg",), "pg"),
    "otel": (("psycopg", "opentelemetry.sdk"), "pg,otel"),
}
MISSING = {room: extra for room, (modules, extra) in NEEDS.items()
           if not all(_installed(module) for module in modules)}

# The PostgreSQL fixtures (tests/pg_fixtures.py, tests/pgbouncer.py) import psycopg; pytest
# only takes plugins from this top-level conftest, so they load here, where psycopg is.
pytest_plugins = [] if "pg" in MISSING else ["tests.pg_fixtures", "tests.pgbouncer"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the fault scenarios (tests/faults) at the full counts")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave out a room whose extra is not installed, unless CI requires everything."""
    if collection_path.parent == HERE and collection_path.name in MISSING and not require_pg():
        return True
    return None  # never False: that would overrule --ignore and the other plugins


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not MISSING or require_pg():
        return []
    rooms = ", ".join(f"tests/{room} [{extra}]" for room, extra in MISSING.items())
    return [f"not collected, their extras are not installed: {rooms}"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Where PostgreSQL is required (CI sets MOS_LEASE_REQUIRE_PG=1), a skip is a failure:
    a suite that silently skipped its database tests proves nothing. Missing tools
    (``tests/tools.py``) fail by themselves under MOS_LEASE_REQUIRE_TOOLS=1."""
    if not require_pg():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        names = ", ".join(getattr(report, "nodeid", "?") for report in skipped[:10])
        if reporter is not None:
            reporter.write_line(f"FAILED: {len(skipped)} test(s) skipped in CI: {names}",
                                red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
