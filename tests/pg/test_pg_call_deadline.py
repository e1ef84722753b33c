"""A call's deadline starts when the caller calls: the wait for the connection, a reconnect
and the statement together stay within ``settings.call_bound()``.

Two calls on one store: a ``load`` through a network that went silent, and 0.2 s later a
``validate`` of a valid grant from another thread (or task). The load holds the store's
connection (or the pool's only one) until its own deadline; the validation must fail
closed (``store_unavailable``) within one bound of its own call, although it then still has
to reconnect, and its denial's audit append gets no bound of its own. Sync and asyncio,
dedicated connection and pool. Before, the validation's bound started only when it got the
connection, a reconnect took libpq's ``connect_timeout`` (at least 2 s) on top, and the
denial's audit append had a whole bound of its own again.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    Reason,
)
from mos_lease_pg import (
    AsyncPostgresLeaseStore,
    ConnectionSettings,
    PostgresLeaseStore,
    make_pool,
    open_async_pool,
)
from tests.pg_support import FaultProxy, unique_name

pytestmark = pytest.mark.pg

SETTINGS = ConnectionSettings(statement_timeout=timedelta(seconds=1), connect_timeout=2,
                              pool_timeout=5.0)
BOUND = SETTINGS.call_bound()  # 2 s
SLACK = 0.6  # the watchdog's tick, the cancel request's grace, a shared machine
LATER = 0.2  # how long after the load the validation is called
GIVE_UP = 15.0


def _identity() -> LeaseIdentity:
    return LeaseIdentity(unique_name("t"), "agent", "binding")


def _judge(reason: object, elapsed: float | None, load_error: BaseException | None) -> None:
    assert elapsed is not None, f"validate did not come back within {GIVE_UP:g} s"
    assert reason is Reason.STORE_UNAVAILABLE, reason
    assert load_error is not None, "the load through the silent network succeeded"
    assert elapsed <= BOUND + SLACK, \
        f"validate took {elapsed:.3f} s from its call, bound {BOUND:g} s"


@pytest.mark.parametrize("source", ["dedicated", "pool"])
def test_sync_validation_waiting_for_the_connection_fails_closed_within_its_bound(
        proxy: FaultProxy, source: str) -> None:
    pool = make_pool(proxy.dsn, SETTINGS, min_size=1, max_size=1) if source == "pool" else None
    store = (PostgresLeaseStore(pool=pool, settings=SETTINGS) if pool is not None
             else PostgresLeaseStore(proxy.dsn, settings=SETTINGS))
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = _identity()
    try:
        lease = coordinator.acquire(identity, "c1", scopes=["x"], ttl=60).lease
        assert lease is not None
        grant = coordinator.issue_grant(lease, scopes=["x"], ttl=20).grant
        assert grant is not None
        proxy.go_silent()
        load_error: list[BaseException] = []

        def load() -> None:
            try:
                store.load(identity)
            except Exception as exc:  # judged below
                load_error.append(exc)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        time.sleep(LATER)
        outcome: list[tuple[object, float]] = []

        def validate() -> None:
            started = time.monotonic()
            result = coordinator.validate(grant, identity=identity, scopes=["x"])
            outcome.append((result.reason, time.monotonic() - started))

        validator = threading.Thread(target=validate, daemon=True)
        validator.start()
        validator.join(GIVE_UP)
        loader.join(GIVE_UP)
        reason, elapsed = outcome[0] if outcome else (None, None)
        _judge(reason, elapsed, load_error[0] if load_error else None)
    finally:
        proxy.refuse()  # hangs up every side: a call still waiting fails now
        store.close()
        if pool is not None:
            pool.close(timeout=1)


@pytest.mark.parametrize("source", ["dedicated", "pool"])
def test_async_validation_waiting_for_the_connection_fails_closed_within_its_bound(
        proxy: FaultProxy, source: str) -> None:

    async def scenario() -> tuple[object, float | None, BaseException | None]:
        pool = (await open_async_pool(proxy.dsn, SETTINGS, min_size=1, max_size=1)
                if source == "pool" else None)
        store = (AsyncPostgresLeaseStore(pool=pool, settings=SETTINGS) if pool is not None
                 else AsyncPostgresLeaseStore(proxy.dsn, settings=SETTINGS))
        coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        identity = _identity()
        loading: asyncio.Task[Any] | None = None
        try:
            lease = (await coordinator.acquire(identity, "c1", scopes=["x"], ttl=60)).lease
            assert lease is not None
            grant = (await coordinator.issue_grant(lease, scopes=["x"], ttl=20)).grant
            assert grant is not None
            proxy.go_silent()
            loading = asyncio.ensure_future(store.load(identity))
            await asyncio.sleep(LATER)
            started = time.monotonic()
            try:
                async with asyncio.timeout(GIVE_UP):
                    result = await coordinator.validate(grant, identity=identity,
                                                        scopes=["x"])
            except TimeoutError:
                return None, None, None
            elapsed = time.monotonic() - started
            done, _ = await asyncio.wait((loading,), timeout=GIVE_UP)
            load_error = loading.exception() if done else None
            return result.reason, elapsed, load_error
        finally:
            proxy.refuse()
            if loading is not None and not loading.done():
                loading.cancel()
            await store.aclose()
            if pool is not None:
                await pool.close(timeout=1)

    _judge(*asyncio.run(scenario()))
