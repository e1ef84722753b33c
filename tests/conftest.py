"""Shared fixtures: every store the conformance kit runs against."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mos_lease.testing import StoreHarness
from mos_lease_memory import MemoryHarness
from tests.pg_support import require_pg

pytest_plugins = ["tests.pg_fixtures", "tests.pgbouncer"]

HarnessFactory = Callable[[], StoreHarness]


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.pg)])
def harness_factory(request: pytest.FixtureRequest) -> HarnessFactory:
    """A factory of fresh harnesses for each shipped store (PostgreSQL ones are marked pg)."""
    if request.param == "postgres":
        factory: HarnessFactory = request.getfixturevalue("pg_harness_factory")
        return factory
    return MemoryHarness


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the fault scenarios (tests/faults) at the full counts")


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
