"""The supervisors on PostgreSQL while a long tool holds one binding's lease row.

A ``fenced_transaction(..., valid_until=ValidUntil.LEASE)`` that stays open keeps its lease
row ``FOR SHARE``. Every binding of the supervisor is renewed in one batch; the batch must
renew all the others on every tick, never wait for that row, and report none of them lost.
The held lease is retried as after a transient failure: renewed once the lock goes, or lost
at its own deadline if the lock outlives it. The thread and the asyncio supervisor, driven
turn by turn on a clock moved together with the store's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    LossCause,
    Reason,
)
from mos_lease.records import LeaseHandle
from mos_lease.supervisor import AsyncSupervisor, BindingLost, BindingStarted, Change, Supervisor
from mos_lease_pg import ConnectionSettings, sql_files
from tests.pg.test_pg_supervisor import FakeTime, _run, _settle
from tests.pg_clock import ShiftedAsyncPostgresLeaseStore
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ("tool:run",)
TTL = 30.0  # renewed every 10 s; deadline 30 - (3 + 2) = 25 s after a renewal's start
N = 60
TICK = TTL / 3 + 0.5
# A short lock_timeout only bounds how long a batch that did wait would take to fail; a
# batch that skips the held row never meets it.
SETTINGS = ConnectionSettings(lock_timeout=timedelta(seconds=0.5))

# What a fenced_transaction takes on its lease row (the tables live in the library's
# schema, named explicitly).
SHARE_ROW = sql.SQL("SELECT 1 FROM {}.logical_agent_connector_leases WHERE tenant_id = %s "
                    "AND logical_agent_id = %s AND binding_id = %s FOR SHARE").format(
                        sql.Identifier(sql_files.DEFAULT_SCHEMA))


class Driven:
    """One supervisor driven turn by turn, whichever kind: ``run`` turns it for some
    seconds of its clock (moved with the store's), ``expiries`` reads the store's rows."""

    def __init__(self, run: Callable[[float], Awaitable[None]],
                 expiry: Callable[[LeaseIdentity], Awaitable[datetime]],
                 lease: Callable[[LeaseIdentity], LeaseHandle | None],
                 supervisor: Supervisor | AsyncSupervisor, changes: list[Change]) -> None:
        self.run = run
        self._expiry = expiry
        self.lease = lease
        self.supervisor = supervisor
        self.changes = changes

    async def expiries(self, identities: list[LeaseIdentity]) -> dict[LeaseIdentity, datetime]:
        return {identity: await self._expiry(identity) for identity in identities}

    def lost(self) -> list[tuple[LeaseIdentity, LossCause]]:
        return [(c.identity, c.loss.cause) for c in self.changes if isinstance(c, BindingLost)]


def _expiry_of(row: Any) -> datetime:
    assert row is not None
    expires: datetime = row.expires_at
    return expires


async def _scenario(driven: Driven, dsn: str, identities: list[LeaseIdentity]) -> None:
    assert sum(isinstance(c, BindingStarted) for c in driven.changes) == N
    held = identities[17]
    others = [identity for identity in identities if identity != held]
    key = (held.tenant_id, held.logical_agent_id, held.binding_id)

    # 1. The tool holds the row for two renewal ticks (21 s: inside the 25 s deadline).
    with psycopg.connect(dsn) as tool:
        tool.execute(SHARE_ROW, key)
        first = (await driven.expiries([held]))[held]
        for tick in range(2):
            before = await driven.expiries(others)
            began = time.monotonic()
            await driven.run(TICK)
            after = await driven.expiries(others)
            assert all(after[i] > before[i] for i in others), f"tick {tick}: not renewed"
            assert driven.lost() == [], f"tick {tick}"
            assert all(driven.lease(i) is not None for i in identities)
            # No batch waited for the lock (each would have taken lock_timeout, 0.5 s).
            assert time.monotonic() - began < 10, f"tick {tick}"
        assert (await driven.expiries([held]))[held] == first  # never written
        tool.commit()
    # The lock is gone: the retry renews the held lease before its deadline.
    await driven.run(3)
    assert (await driven.expiries([held]))[held] > first
    assert driven.lost() == []
    assert all(driven.lease(i) is not None for i in identities)

    # 2. The tool holds the row past the held lease's deadline: that lease alone is lost,
    # at its own deadline, as after any transient failure; every other is still renewed.
    with psycopg.connect(dsn) as tool:
        tool.execute(SHARE_ROW, key)
        for tick in range(3):
            before = await driven.expiries(others)
            await driven.run(TICK)
            after = await driven.expiries(others)
            assert all(after[i] > before[i] for i in others), f"tick {tick}: not renewed"
        tool.commit()
    assert driven.lost() == [(held, LossCause.DEADLINE)]
    (loss,) = [c.loss for c in driven.changes if isinstance(c, BindingLost)]
    assert loss.reason is Reason.LEASE_EXPIRED
    assert loss.error is not None and "store_unavailable" in loss.error
    state = driven.supervisor._core.schedule.slots[held].state
    assert state is not None and 0 <= loss.at - state.deadline < 1.0  # at its deadline
    assert all(driven.lease(i) is not None for i in others)


def test_a_row_held_across_renewal_ticks_costs_the_other_bindings_nothing(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    inner = pg_stores(settings=SETTINGS)
    clock = FakeTime(inner)
    coordinator = ConnectorLeaseCoordinator(inner, AllowAllPolicy(), monotonic_clock=clock)
    changes: list[Change] = []
    sleeps: list[float] = []
    supervisor = Supervisor(coordinator, on_change=changes.append, clock=clock,
                            sleep=sleeps.append, random=lambda: 0.5, background=False)
    identities = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(N)]
    for identity in identities:
        supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=TTL)
    _settle(supervisor, sleeps)

    async def run(seconds: float) -> None:
        _run(supervisor, sleeps, clock, seconds)

    async def expiry(identity: LeaseIdentity) -> datetime:
        return _expiry_of(inner.load(identity).row)

    try:
        asyncio.run(_scenario(Driven(run, expiry, supervisor.lease, supervisor, changes),
                              pg_dsn, identities))
    finally:
        supervisor.close()


def test_the_asyncio_supervisor_beside_a_held_row(pg_dsn: str, pg_tenant: str) -> None:
    async def main() -> None:
        async with ShiftedAsyncPostgresLeaseStore(pg_dsn, settings=SETTINGS) as store:
            clock = FakeTime(store)
            coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy(),
                                                         monotonic_clock=clock)
            changes: list[Change] = []
            sleeps: list[float] = []

            async def sleep(seconds: float) -> None:
                sleeps.append(seconds)

            supervisor = AsyncSupervisor(coordinator, on_change=changes.append, clock=clock,
                                         sleep=sleep, random=lambda: 0.5, background=False)

            async def settle() -> None:
                before = len(sleeps)
                while len(sleeps) == before:
                    await supervisor.turn()

            async def run(seconds: float) -> None:
                end = clock.mono + seconds
                while True:
                    await settle()
                    if clock.mono >= end:
                        return
                    clock.advance(0.5)

            async def expiry(identity: LeaseIdentity) -> datetime:
                return _expiry_of((await store.load(identity)).row)

            identities = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(N)]
            for identity in identities:
                supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=TTL)
            await settle()
            try:
                await _scenario(Driven(run, expiry, supervisor.lease, supervisor, changes),
                                pg_dsn, identities)
            finally:
                await supervisor.close()

    asyncio.run(main())
