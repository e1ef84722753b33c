"""A store's first call is bounded in time like every other: the schema check of its first
connection (``preflight.first_use``) runs within the call's deadline.

Through a proxy that relays the connection's opening and goes silent at the check's first
query (nothing forwarded, nothing closed: the kernel keeps acknowledging, so neither TCP
keepalives nor ``tcp_user_timeout`` notice), the first call must raise ``StoreUnavailable``
within ``settings.call_bound()`` plus a small slack, sync and async, on a dedicated
connection and on a pooled one. Without the watch it waited for as long as the network
stayed silent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from psycopg.conninfo import make_conninfo

from mos_lease import StoreUnavailable
from mos_lease_pg import (
    AsyncPostgresLeaseStore,
    ConnectionSettings,
    PostgresLeaseStore,
    make_pool,
    open_async_pool,
)
from tests.faults.support import HostileFault, HostileProxy

pytestmark = pytest.mark.pg

SETTINGS = ConnectionSettings(statement_timeout=timedelta(seconds=1), pool_timeout=5.0)
BOUND = SETTINGS.call_bound()  # 2 s
SLACK = 0.6  # the watchdog's tick, the cancel request's grace, a shared machine
GIVE_UP = BOUND + 5.0  # how long the test waits for a call that never comes back


@pytest.fixture
def hostile(pg_dsn: str) -> Iterator[tuple[HostileProxy, str]]:
    proxy = HostileProxy(pg_dsn)
    # No SSL or GSS negotiation: the startup packet is a new connection's first message.
    dsn = make_conninfo(proxy.dsn, sslmode="disable", gssencmode="disable")
    try:
        yield proxy, dsn
    finally:
        proxy.close()


def _silent_at_the_check(proxy: HostileProxy, *, opened: bool) -> None:
    # The check's first query is the next message of an opened (pooled) connection, the
    # second of a dedicated one, opened by the call itself.
    proxy.arm(HostileFault.SILENT, at=1 if opened else 2)


def _judge(proxy: HostileProxy, raised: BaseException | None, elapsed: float | None) -> None:
    assert proxy.struck, "the proxy never went silent: the check sent no query"
    assert elapsed is not None, f"the first call did not come back within {GIVE_UP:g} s"
    assert isinstance(raised, StoreUnavailable), raised
    assert elapsed <= BOUND + SLACK, f"{elapsed:.3f} s, bound {BOUND:g} s"


@pytest.mark.parametrize("source", ["dedicated", "pool"])
def test_sync_first_call_through_a_silent_network_is_bounded(
        hostile: tuple[HostileProxy, str], source: str) -> None:
    proxy, dsn = hostile
    pool = make_pool(dsn, SETTINGS) if source == "pool" else None
    if pool is not None:
        pool.wait()
    store = (PostgresLeaseStore(pool=pool, settings=SETTINGS) if pool is not None
             else PostgresLeaseStore(dsn, settings=SETTINGS))
    _silent_at_the_check(proxy, opened=pool is not None)
    outcome: list[tuple[BaseException | None, float]] = []

    def first_call() -> None:
        started = time.monotonic()
        try:
            store.now()
        except BaseException as exc:  # judged below
            outcome.append((exc, time.monotonic() - started))
        else:
            outcome.append((None, time.monotonic() - started))

    worker = threading.Thread(target=first_call, daemon=True)
    try:
        worker.start()
        worker.join(timeout=GIVE_UP)
        raised, elapsed = outcome[0] if outcome else (None, None)
        _judge(proxy, raised, elapsed)
    finally:
        # Healed before anything is closed: a pool's reconnect then completes instead of
        # racing the proxy's own close.
        proxy.heal()
        if worker.is_alive():
            proxy.close()  # hangs up every side: the call still waiting fails now
        worker.join(timeout=GIVE_UP)
        store.close()
        if pool is not None:
            pool.close()


@pytest.mark.parametrize("source", ["dedicated", "pool"])
def test_async_first_call_through_a_silent_network_is_bounded(
        hostile: tuple[HostileProxy, str], source: str) -> None:
    proxy, dsn = hostile

    async def scenario() -> tuple[BaseException | None, float | None]:
        pool = await open_async_pool(dsn, SETTINGS) if source == "pool" else None
        if pool is not None:
            await pool.wait()
        store = (AsyncPostgresLeaseStore(pool=pool, settings=SETTINGS) if pool is not None
                 else AsyncPostgresLeaseStore(dsn, settings=SETTINGS))
        _silent_at_the_check(proxy, opened=pool is not None)
        started = time.monotonic()
        try:
            await asyncio.wait_for(store.now(), GIVE_UP)
        except TimeoutError:
            return None, None
        except BaseException as exc:  # judged below
            return exc, time.monotonic() - started
        finally:
            proxy.heal()  # as in the sync test
            await store.aclose()
            if pool is not None:
                await pool.close()
        return None, time.monotonic() - started

    _judge(proxy, *asyncio.run(scenario()))
