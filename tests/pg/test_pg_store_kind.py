"""The PostgreSQL stores as coordinators and holders see them: a store of the other kind is
refused when the coordinator is built (nothing is sent), and the store's time can step at a
failover, so a ttl too short for the clock-step margin is refused naming its options."""

from __future__ import annotations

import asyncio

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    hold,
)
from mos_lease.holder import HoldTiming
from mos_lease.keeper import DEFAULT_CLOCK_STEP, default_clock_step
from mos_lease_pg import AsyncPostgresLeaseStore, PostgresLeaseStore
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

# Never connected to: the refusal comes before any use.
NOWHERE = "postgresql://nobody@127.0.0.1:1/nothing"


def test_a_synchronous_coordinator_refuses_the_asyncio_store() -> None:
    store = AsyncPostgresLeaseStore(NOWHERE)
    with pytest.raises(ConfigurationError, match=r"AsyncPostgresLeaseStore is an asyncio store"
                       r".*use AsyncConnectorLeaseCoordinator"):
        ConnectorLeaseCoordinator(store, AllowAllPolicy())  # type: ignore[arg-type]


def test_an_asyncio_coordinator_refuses_the_synchronous_store() -> None:
    with PostgresLeaseStore(NOWHERE) as store, pytest.raises(
            ConfigurationError, match=r"PostgresLeaseStore is a synchronous store"
            r".*use ConnectorLeaseCoordinator"):
        AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())  # type: ignore[arg-type]


def test_the_postgresql_stores_keep_the_clock_step_margin(pg_stores: StoreFactory) -> None:
    store = pg_stores()
    assert default_clock_step(store) == DEFAULT_CLOCK_STEP
    assert default_clock_step(AsyncPostgresLeaseStore(NOWHERE)) == DEFAULT_CLOCK_STEP
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity("tenant", "agent-short-ttl", "b")
    with pytest.raises(ConfigurationError, match=r"a ttl above 4 s, or safety_margin="):
        hold(gateway, identity, "conn-a", scopes=["tool:run"], ttl=3)
    with hold(gateway, identity, "conn-a", scopes=["tool:run"], ttl=3, wait=0,
              timing=HoldTiming(safety_margin=0.5)) as held:
        assert held.lease.epoch == 1


def test_an_asyncio_coordinator_takes_the_asyncio_store(pg_dsn: str) -> None:
    async def main() -> None:
        store = AsyncPostgresLeaseStore(pg_dsn)
        try:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            assert await gateway.current_holder(LeaseIdentity("t", "never-held", "b")) is None
        finally:
            await store.aclose()

    asyncio.run(main())
