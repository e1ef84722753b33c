"""The supervisors on PostgreSQL with one of their two renewal connections gone silent.

A supervisor renews through two coordinators, each a store on a connection of its own; the
second reaches PostgreSQL through a proxy that goes silent (nothing forwarded either way,
nothing closed, new connections too: a network path that died). 2,500 bindings make three
renewal batches a tick. Each batch sent to the silent connection is given up on while its
leases have time left, and they are renewed through the other connection; the batches
behind it are sent in time. No binding may be lost. (The code before this rule lost 1,000
of 3,000 bindings in such a run, and 9,000 of 10,000.) 200 bindings make one batch a tick,
with no batch of the other connection beside it: at half its time it is sent again on the
other connection, whose results come first (the code before lost every binding once). Real
time, ttl 3 s: a renewal every second, a deadline 2.7 s after a renewal's start (one
database host: no clock step).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
)
from mos_lease.supervisor import AsyncSupervisor, BindingLost, Supervisor
from mos_lease_pg import AsyncPostgresLeaseStore, PostgresLeaseStore
from tests.faults.support import HostileFault, HostileProxy

pytestmark = pytest.mark.pg

SIZES = pytest.mark.parametrize("n", [2500, 200], ids=["three batches a tick",
                                                       "one batch a tick"])
TTL = 3.0
WATCHED = 6.0  # two ttls: six renewal ticks after the connection went silent
SCOPES = ("tool:run",)


def bindings(n: int) -> list[LeaseIdentity]:
    run = uuid.uuid4().hex[:8]
    return [LeaseIdentity("acme", f"silent-{run}-{i}", "main") for i in range(n)]


def judged(changes: list[Any], held: int, n: int) -> None:
    assert [c.identity for c in changes if isinstance(c, BindingLost)] == []
    assert held == n


@SIZES
def test_the_thread_supervisor_loses_nothing_to_a_renewal_connection_gone_silent(
        pg_dsn: str, n: int) -> None:
    changes: list[Any] = []
    with contextlib.ExitStack() as stack:
        proxy = HostileProxy(pg_dsn)
        stack.callback(proxy.close)
        store = stack.enter_context(PostgresLeaseStore(pg_dsn))
        renewers = [ConnectorLeaseCoordinator(stack.enter_context(PostgresLeaseStore(dsn)),
                                              AllowAllPolicy()) for dsn in (pg_dsn, proxy.dsn)]
        supervisor = Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()),
                                on_change=changes.append, heartbeat_coordinator=renewers)
        stack.callback(supervisor.close)
        stack.callback(proxy.heal)  # before the close: it releases through both
        names = bindings(n)
        for name in names:
            supervisor.add(name, "gw", scopes=SCOPES, ttl=TTL, clock_step=0)
        deadline = time.monotonic() + 30
        while supervisor.stats().bindings_held < n and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(TTL)  # both renewal connections in use
        proxy.arm(HostileFault.SILENT)
        time.sleep(WATCHED)
        judged(changes, sum(supervisor.lease(name) is not None for name in names), n)


@SIZES
def test_the_asyncio_supervisor_loses_nothing_to_a_renewal_connection_gone_silent(
        pg_dsn: str, n: int) -> None:
    async def main() -> None:
        changes: list[Any] = []
        async with contextlib.AsyncExitStack() as stack:
            proxy = HostileProxy(pg_dsn)
            stack.callback(proxy.close)
            store = await stack.enter_async_context(AsyncPostgresLeaseStore(pg_dsn))
            renewers = [AsyncConnectorLeaseCoordinator(
                await stack.enter_async_context(AsyncPostgresLeaseStore(dsn)),
                AllowAllPolicy()) for dsn in (pg_dsn, proxy.dsn)]
            supervisor = AsyncSupervisor(AsyncConnectorLeaseCoordinator(store, AllowAllPolicy()),
                                         on_change=changes.append,
                                         heartbeat_coordinator=renewers)
            stack.push_async_callback(supervisor.close)
            stack.callback(proxy.heal)
            names = bindings(n)
            for name in names:
                supervisor.add(name, "gw", scopes=SCOPES, ttl=TTL, clock_step=0)
            deadline = time.monotonic() + 30
            while supervisor.stats().bindings_held < n and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(TTL)
            proxy.arm(HostileFault.SILENT)
            await asyncio.sleep(WATCHED)
            judged(changes, sum(supervisor.lease(name) is not None for name in names), n)

    asyncio.run(main())
