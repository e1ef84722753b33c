"""The store's fast path: a call that succeeds builds nothing around its statement, every
deadline is read on the clock the store was given, and a connection's reusable deadline
watch never cuts a later call short for an earlier one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import psycopg
import pytest

from mos_lease.errors import StoreUnavailable
from mos_lease_pg import AsyncPostgresLeaseStore, ConnectionSettings, PostgresLeaseStore, store_core
from mos_lease_pg.deadline import Watch, Watchdog

pytestmark = pytest.mark.pg


class JumpingClock:
    """A monotonic clock that jumps an hour ahead after its first read once armed."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.armed = False

    def __call__(self) -> float:
        now = self.now
        if self.armed:
            self.now += 3600.0
        return now


@pytest.fixture
def clocked(pg_dsn: str) -> Iterator[tuple[PostgresLeaseStore, JumpingClock]]:
    clock = JumpingClock()
    with PostgresLeaseStore(pg_dsn, clock=clock) as store:
        yield store, clock


def test_a_successful_call_builds_no_resend_flow(
        clocked: tuple[PostgresLeaseStore, JumpingClock],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = clocked
    store.now()  # the first call opens and checks the connection

    def forbidden(*_args: object) -> None:
        raise AssertionError("a call that succeeded built its resend flow")

    monkeypatch.setattr(store_core, "resending", forbidden)
    store.now()


def test_the_wait_for_a_busy_connection_is_read_on_the_stores_clock(
        clocked: tuple[PostgresLeaseStore, JumpingClock]) -> None:
    store, clock = clocked
    store.now()
    source = store._source
    wire = source.enter(None)  # another caller holds the dedicated connection
    errors: list[BaseException] = []

    def call() -> None:
        try:
            store.now()
        except StoreUnavailable as exc:
            errors.append(exc)

    try:
        # The call reads its deadline, then the store's clock says an hour went by: the
        # wait for the connection gives up at once, whatever time.monotonic says (the
        # real bound is 6 s).
        clock.armed = True
        worker = threading.Thread(target=call)
        worker.start()
        worker.join(timeout=3.0)
        assert not worker.is_alive(), "the wait ignored the store's clock"
        assert errors and "stayed busy" in str(errors[0])
    finally:
        source.leave(wire)


class _StillDog(Watchdog):
    """A watchdog that never runs its thread: the test plays its part."""

    def watch(self, watch: Watch) -> None:
        pass


def test_a_firing_decided_for_one_call_spares_the_next(pg_dsn: str) -> None:
    now = [0.0]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        watch = Watch(conn, lambda: now[0], _StillDog())
        watch.arm(10.0, 6.0)
        now[0] = 20.0
        stale = watch.due()  # the watchdog decided to fire this arming...
        assert stale is not None and watch.due() is None  # (once)
        watch.done()  # ...but the call finished first, and the next one armed the watch
        now[0] = 0.0
        with watch.arm(10.0, 6.0):
            watch.fire(stale)  # the late firing of the first arming
            assert not watch.fired and watch.due() is None
            assert conn.execute(b"SELECT 1").fetchone() == (1,)
        assert not conn.closed


def test_settings_are_read_once(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with PostgresLeaseStore(pg_dsn, settings=ConnectionSettings()) as store:
        store.now()

        def forbidden(_self: ConnectionSettings) -> float:
            raise AssertionError("the call bound was computed again")

        monkeypatch.setattr(ConnectionSettings, "call_bound", forbidden)
        store.now()


def test_the_asyncio_store_reads_the_same_clock(pg_dsn: str) -> None:
    async def scenario() -> str:
        clock = JumpingClock()
        store = AsyncPostgresLeaseStore(pg_dsn, clock=clock)
        try:
            await store.now()
            wire = await store._source.enter(None)  # another task holds the connection
            try:
                clock.armed = True
                with pytest.raises(StoreUnavailable) as refused:
                    await asyncio.wait_for(store.now(), 3.0)
                return str(refused.value)
            finally:
                await store._source.leave(wire)
        finally:
            await store.aclose()

    assert "stayed busy" in asyncio.run(scenario())
