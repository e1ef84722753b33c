"""Shared fixtures: every store the conformance kit runs against."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mos_lease.testing import MemoryHarness, StoreHarness

HarnessFactory = Callable[[], StoreHarness]


@pytest.fixture(params=["memory"])
def harness_factory(request: pytest.FixtureRequest) -> HarnessFactory:
    """A factory of fresh harnesses for each shipped store (PostgreSQL ones are marked pg)."""
    assert request.param == "memory"
    return MemoryHarness
