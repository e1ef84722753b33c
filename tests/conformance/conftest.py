"""The stores the conformance kit runs against: the in-memory reference, and PostgreSQL
(marked ``pg``; its harness comes from ``tests/pg_fixtures.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mos_lease.testing import StoreHarness
from mos_lease_memory import MemoryHarness

HarnessFactory = Callable[[], StoreHarness]


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.pg)])
def harness_factory(request: pytest.FixtureRequest) -> HarnessFactory:
    """A factory of fresh harnesses for each shipped store (PostgreSQL ones are marked pg)."""
    if request.param == "postgres":
        factory: HarnessFactory = request.getfixturevalue("pg_harness_factory")
        return factory
    return MemoryHarness
