"""Push notices of takeovers and releases (``NOTIFY``) on a real PostgreSQL server.

The statements are checked from a plain psycopg connection that LISTENs, as any outsider
could; the holder tests race a rival's takeover against a 30 s TTL, so only a notice can
explain a loss noticed within half a second; the listener is cut off, refused and fed
forged payloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseIdentity,
    LeaseNotAcquired,
    LossCause,
    Reason,
    hold,
)
from mos_lease.errors import ConfigurationError
from mos_lease.events import Renewed
from mos_lease.holder import HoldCallbacks, HoldTiming
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.notice_gate import NoticeStats
from mos_lease_pg import AsyncPostgresLeaseStore, LeaseNotices
from mos_lease_pg.notices import parse_notice
from mos_lease_pg.statements import notice_channel
from tests.notice_flood import (
    Heard,
    count_loads,
    send_flood,
    turn_bound,
    unprivileged_login,
)
from tests.pg_fixtures import PgSchema, StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ["tool:run"]
FAST = 0.5  # seconds: "at once", against a 30 s TTL and 10 s pauses


def heard(conn: psycopg.Connection[Any], tenant: str, expect: int = 0) -> list[Any]:
    """The payloads for ``tenant`` (with their channel and JSON): until ``expect`` have come
    (at most 5 s, on a busy machine), or all that come within 0.3 s if none is expected."""
    found: list[Any] = []
    deadline = time.monotonic() + (5.0 if expect else 0.3)
    while (remaining := deadline - time.monotonic()) > 0 and (not expect or len(found) < expect):
        for notify in conn.notifies(timeout=remaining, stop_after=1):
            with contextlib.suppress(ValueError):
                data = json.loads(notify.payload)
                if isinstance(data, dict) and data.get("t") == tenant:
                    found.append((notify.channel, notify.payload, data))
    return found


@pytest.fixture
def listener(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notice_channel())))
        yield conn


@pytest.fixture
def notices(pg_dsn: str) -> Iterator[LeaseNotices]:
    with LeaseNotices(pg_dsn) as source:
        assert source.listening.wait(5), source.refused
        yield source


def test_takeover_and_release_notify_nothing_else_does(
        pg_stores: StoreFactory, pg_tenant: str, listener: psycopg.Connection[Any]) -> None:
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    first = gateway.acquire(identity, "first-connector", scopes=SCOPES, ttl=30).lease
    assert first is not None
    assert gateway.heartbeat(first, ttl=30).ok
    assert not gateway.takeover(identity, "c2", scopes=SCOPES, ttl=30, expected_epoch=7).ok
    assert heard(listener, pg_tenant) == []  # acquire, heartbeat, a refused takeover

    assert gateway.release(first).ok
    [(channel, payload, data)] = heard(listener, pg_tenant, expect=1)
    assert channel == "mos_lease_mos_lease"
    assert data == {"t": pg_tenant, "a": "agent", "b": "b1", "e": 1, "k": "release"}
    assert str(first.lease_id) not in payload and "tool:run" not in payload
    assert "first-connector" not in payload  # nor the connector

    assert not gateway.release(first).ok  # refused: already released
    assert heard(listener, pg_tenant) == []

    second = gateway.takeover(identity, "c2", scopes=SCOPES, ttl=30, expected_epoch=1).lease
    assert second is not None
    [(_, payload, data)] = heard(listener, pg_tenant, expect=1)
    assert data == {"t": pg_tenant, "a": "agent", "b": "b1", "e": 2, "k": "takeover"}
    assert str(second.lease_id) not in payload and str(first.lease_id) not in payload
    assert parse_notice(payload) == (identity, 2, "takeover")
    assert heard(listener, pg_tenant) == []  # one notice per write


def test_longest_and_oddest_identity_still_writes_and_round_trips(
        pg_stores: StoreFactory, listener: psycopg.Connection[Any]) -> None:
    # 128 characters of 4 UTF-8 bytes each, with JSON's special characters: the payload
    # must stay under PostgreSQL's 8000-byte limit (a longer one would fail the write) and
    # be read back as the same identity, not as whatever the quotes try to inject.
    tenant = '"},\\' + "\U0001F600" * 123
    identity = LeaseIdentity(tenant, '","k":"takeover', "b" * 128)
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    lease = gateway.acquire(identity, "c1", scopes=SCOPES, ttl=30).lease
    assert lease is not None and gateway.release(lease).ok
    assert gateway.takeover(identity, "c2", scopes=SCOPES, ttl=30, expected_epoch=1).ok
    payloads = [p for _, p, _ in heard(listener, tenant, expect=2)]
    assert [parse_notice(p) for p in payloads] == [(identity, 1, "release"),
                                                   (identity, 2, "takeover")]


def test_each_schema_has_its_own_channel(pg_stores: StoreFactory, pg_tenant: str,
                                         pg_migrated_schema_dsn: PgSchema,
                                         listener: psycopg.Connection[Any]) -> None:
    own = pg_migrated_schema_dsn
    store = pg_stores(own.dsn, settings=own.settings())
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    with psycopg.connect(own.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notice_channel(own.schema))))
        lease = gateway.acquire(identity, "c1", scopes=SCOPES, ttl=30).lease
        assert lease is not None and gateway.release(lease).ok
        assert [d["k"] for _, _, d in heard(conn, pg_tenant, expect=1)] == ["release"]
    assert heard(listener, pg_tenant) == []  # the default schema's channel heard nothing


def test_channel_fits_postgresql_for_the_longest_schema(
        pg_admin: psycopg.Connection[Any]) -> None:
    longest = notice_channel("s" * 63)
    assert len(longest) == 63 and longest.startswith("mos_lease_")
    assert longest != notice_channel("t" * 63)
    pg_admin.execute("SELECT pg_notify(%s, '')", [longest])  # a longer name is an error
    with pytest.raises(ConfigurationError):
        notice_channel("Bad-Schema")


@pytest.mark.parametrize("pushed", [True, False], ids=["notices", "control"])
def test_holder_learns_of_a_takeover_at_once(pg_stores: StoreFactory, pg_tenant: str,
                                             notices: LeaseNotices, pushed: bool) -> None:
    rival = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    lost: list[float] = []
    with hold(ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy()), identity, "c1",
              scopes=SCOPES, ttl=30, notices=notices if pushed else None,
              timing=HoldTiming(clock_step=0),
              callbacks=HoldCallbacks(on_lost=lambda _loss: lost.append(time.monotonic()))) as held:
        taken = rival.takeover(identity, "c2", scopes=SCOPES, ttl=30,
                               expected_epoch=held.lease.epoch)
        committed = time.monotonic()
        assert taken.ok
        loss = held.wait_lost(FAST)
        if not pushed:  # without notices, nothing can tell it for ~10 s
            assert loss is None and held.lost is None and lost == []
            return
        assert loss is not None and (loss.cause, loss.reason) == (LossCause.DENIED,
                                                                  Reason.STALE_EPOCH)
        assert lost and lost[0] - committed < FAST
    assert identity not in notices._subscribers  # unsubscribed on leaving
    late = hold(ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy()), identity, "c3",
                scopes=SCOPES, ttl=30, wait=0, notices=notices, timing=HoldTiming(clock_step=0))
    with pytest.raises(LeaseNotAcquired):
        late.__enter__()
    assert identity not in notices._subscribers  # and when the wait gave up


def test_a_forged_takeover_notice_does_not_end_a_holding(
        pg_stores: StoreFactory, pg_tenant: str, notices: LeaseNotices,
        pg_admin: psycopg.Connection[Any]) -> None:
    # Any login may send NOTIFY: a well-formed notice of a newer epoch that the store does not
    # confirm (one read) must leave the holder holding.
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    with hold(ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy()), identity, "c1",
              scopes=SCOPES, ttl=30, notices=notices, timing=HoldTiming(clock_step=0)) as held:
        forged = json.dumps({"t": identity.tenant_id, "a": identity.logical_agent_id,
                             "b": identity.binding_id, "e": held.lease.epoch + 1,
                             "k": "takeover"}, separators=(",", ":"))
        pg_admin.execute("SELECT pg_notify(%s, %s)", [notice_channel(), forged])
        assert held.wait_lost(FAST) is None
        assert held.lost is None and held.issue_grant(scopes=SCOPES, ttl=1).ok


@pytest.mark.parametrize("pushed", [True, False], ids=["notices", "control"])
def test_waiter_wakes_on_release_at_once(pg_stores: StoreFactory, pg_tenant: str,
                                         notices: LeaseNotices, pushed: bool) -> None:
    owner = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    lease = owner.acquire(identity, "c1", scopes=SCOPES, ttl=30).lease
    assert lease is not None
    seen, started = threading.Event(), threading.Event()
    acquired_at: list[float] = []

    def on_started(_lease: object) -> None:
        acquired_at.append(time.monotonic())
        started.set()

    def wait_for_it() -> None:
        # Pauses of 10 s; wait=1.5 bounds the polling waiter, which has no notice to end it.
        with hold(ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy()), identity, "c2",
                  scopes=SCOPES, ttl=30, wait=20 if pushed else 1.5,
                  notices=notices if pushed else None,
                  timing=HoldTiming(clock_step=0, min_backoff=10, max_backoff=10),
                  callbacks=HoldCallbacks(on_new_holder=lambda *_: seen.set(),
                                          on_started=on_started)):
            pass

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    try:
        assert seen.wait(5)
        time.sleep(0.2)  # into its 10 s pause
        assert owner.release(lease).ok
        released = time.monotonic()
        woke = started.wait(FAST)
        if pushed:
            assert woke and acquired_at[0] - released < FAST
        else:
            assert not woke  # polling: still in its pause
    finally:
        waiter.join(5)
    assert not waiter.is_alive()
    assert identity not in notices._subscribers  # unsubscribed on leaving


def test_async_holder_learns_of_a_takeover_at_once(pg_dsn: str, pg_stores: StoreFactory,
                                                   pg_tenant: str,
                                                   notices: LeaseNotices) -> None:
    identity = LeaseIdentity(pg_tenant, "async", "b1")
    rival = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())

    async def run() -> float:
        store = AsyncPostgresLeaseStore(pg_dsn)
        try:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            async with hold(gateway, identity, "c1", scopes=SCOPES, ttl=30, notices=notices,
                            timing=HoldTiming(clock_step=0)) as held:
                committed: list[float] = []

                def take_over(epoch: int = held.lease.epoch) -> None:
                    assert rival.takeover(identity, "c2", scopes=SCOPES, ttl=30,
                                          expected_epoch=epoch).ok
                    committed.append(time.monotonic())

                # From a plain thread while the loop sits idle in wait_lost(): only a notice
                # handed to the loop thread-safely can wake it before the 5 s timeout.
                rival_thread = threading.Timer(0.1, take_over)
                rival_thread.start()
                await asyncio.wait_for(held.wait_lost(), 5)
                woke = time.monotonic()
                rival_thread.join()
                return woke - committed[0]
        finally:
            await store.aclose()

    assert asyncio.run(run()) < FAST


def test_listener_reconnects_after_its_connection_is_cut(
        pg_admin: psycopg.Connection[Any], pg_stores: StoreFactory, pg_tenant: str,
        notices: LeaseNotices) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    got: list[tuple[int, str]] = []
    notices.subscribe(identity, lambda epoch, kind: got.append((epoch, kind)))
    killed = pg_admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN %%'"
        " AND datname = current_database() AND pid <> pg_backend_pid()").fetchall()
    assert killed
    deadline = time.monotonic() + 5
    while notices.listening.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert notices.listening.wait(5)  # listening again
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    lease = gateway.acquire(identity, "c1", scopes=SCOPES, ttl=30).lease
    assert lease is not None and gateway.release(lease).ok
    deadline = time.monotonic() + FAST
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [(1, "release")]


def test_refused_listen_warns_once_and_holding_still_works(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # What a proxy that refuses LISTEN does: the server answers the statement with an error.
    real_execute = psycopg.Connection.execute

    def refusing(self: psycopg.Connection[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(query, sql.Composable) and query.as_string(self).startswith("LISTEN"):
            raise psycopg.errors.FeatureNotSupported("LISTEN is not supported here")
        return real_execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", refusing)
    caplog.set_level(logging.WARNING, logger="mos_lease_pg.notices")
    source = LeaseNotices(pg_dsn)
    source._thread.join(5)
    monkeypatch.undo()
    assert not source._thread.is_alive() and not source.listening.is_set()
    assert source.refused is not None and "not supported" in source.refused
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "heartbeat" in warnings[0].getMessage()

    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    with hold(gateway, identity, "c1", scopes=SCOPES, ttl=30, notices=source,
              timing=HoldTiming(clock_step=0)) as held:
        assert held.issue_grant(scopes=SCOPES, ttl=10).ok
    with hold(gateway, identity, "c2", scopes=SCOPES, ttl=30, wait=5, notices=source,
              timing=HoldTiming(clock_step=0)) as held:
        assert held.lease.epoch == 2  # the next holder took the released lease over
    source.close()


BAD_PAYLOADS = [
    "", "not json", "[" * 7990, "[]", "null", '{"t":"t","a":"a","b":"b","e":2}',
    '{"t":"t","a":"a","b":"b","e":2,"k":"takeover","x":1}',
    '{"t":"t","a":"a","b":"b","e":"2","k":"takeover"}',
    '{"t":"t","a":"a","b":"b","e":2.0,"k":"takeover"}',
    '{"t":"t","a":"a","b":"b","e":true,"k":"takeover"}',
    '{"t":"t","a":"a","b":"b","e":0,"k":"takeover"}',
    '{"t":"t","a":"a","b":"b","e":2,"k":"grant"}',
    '{"t":"","a":"a","b":"b","e":2,"k":"takeover"}',
    '{"t":1,"a":"a","b":"b","e":2,"k":"takeover"}',
]


@pytest.mark.parametrize("payload", BAD_PAYLOADS)
def test_bad_payloads_are_dropped(payload: str) -> None:
    assert parse_notice(payload) is None


def test_forged_payloads_reach_no_callback(pg_admin: psycopg.Connection[Any], pg_tenant: str,
                                           notices: LeaseNotices,
                                           caplog: pytest.LogCaptureFixture) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    got: list[tuple[int, str]] = []
    notices.subscribe(identity, lambda epoch, kind: got.append((epoch, kind)))
    caplog.set_level(logging.DEBUG, logger="mos_lease_pg.notices")
    for payload in BAD_PAYLOADS[:4]:
        pg_admin.execute("SELECT pg_notify(%s, %s)", [notice_channel(), payload])
    good = json.dumps({"t": pg_tenant, "a": "agent", "b": "b1", "e": 3, "k": "release"})
    pg_admin.execute("SELECT pg_notify(%s, %s)", [notice_channel(), good])
    deadline = time.monotonic() + 2
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [(3, "release")]  # the well-formed one only, after the others
    assert (notices.received, notices.malformed) == (5, 4)
    dropped = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(dropped) == 4 and all(r.levelno == logging.DEBUG for r in dropped)


def test_bad_input_is_refused(pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str,
                              notices: LeaseNotices) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    with pytest.raises(InvalidInput, match="identity"):
        notices.subscribe(("t", "a", "b"), lambda *_: None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="identity"):
        notices.unsubscribe("t/a/b", lambda *_: None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="callback"):
        notices.subscribe(identity, "print")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        LeaseNotices("host=127.0.0.1 port='unterminated")
    with pytest.raises(InvalidInput, match="settings"):
        LeaseNotices(pg_dsn, settings={"schema": "x"})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="confirmer"):
        LeaseNotices(pg_dsn, confirmer=object())  # type: ignore[arg-type]
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    with pytest.raises(InvalidInput, match="notices"):
        hold(gateway, identity, "c1", scopes=SCOPES, ttl=30, notices=object(),
             timing=HoldTiming(clock_step=0))  # type: ignore[call-overload]
    assert gateway.current_holder(identity) is None  # nothing was written


# --- a flood of forged notices ---------------------------------------------------------------

FLOOD = 50_000  # what one statement of an unprivileged login sends in about 0.1 s


@pytest.fixture
def own_notices(pg_dsn: str) -> Iterator[LeaseNotices]:
    """A listener whose holders use a confirmer of their own: its counts and its one
    warning belong to this test alone."""
    with LeaseNotices(pg_dsn) as source:
        source.confirmer = NoticeConfirmer()
        assert source.listening.wait(5), source.refused
        yield source


def flood_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "mos_lease.notices" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("kind", ["thread", "asyncio"])
def test_a_flood_of_forged_notices_ends_no_holding_and_reads_within_the_bound(
        pg_dsn: str, pg_admin: psycopg.Connection[Any], pg_stores: StoreFactory,
        pg_tenant: str, own_notices: LeaseNotices, kind: str,
        caplog: pytest.LogCaptureFixture) -> None:
    # 50,000 distinct takeover notices of newer epochs, from a login with no privilege at
    # all, against a 5 s lease: held 6 s past the flood's start (a lease whose renewals
    # were starved would have reached its local deadline, 4.5 s), renewed all along, the
    # store still answering, and no more confirming reads than the bound allows.
    caplog.set_level(logging.WARNING, logger="mos_lease.notices")
    identity = LeaseIdentity(pg_tenant, kind, "b1")
    confirmer = own_notices.confirmer
    renewals: list[float] = []

    def on_event(event: object) -> None:
        if isinstance(event, Renewed):
            renewals.append(event.duration)

    heard = Heard(own_notices, identity)
    loads = [0]
    at_heard: list[tuple[float, NoticeStats]] = []

    def flood_heard() -> None:
        # Within the 6 s held: when the listener has taken the whole flood in, the turns
        # started so far.
        at_heard.append((heard.wait_for(FLOOD, 5.0), confirmer.stats()))

    with unprivileged_login(pg_admin, pg_dsn) as forger:
        if kind == "thread":
            store = pg_stores()
            counted = count_loads(store)
            with hold(ConnectorLeaseCoordinator(store, AllowAllPolicy()), identity, "c1",
                      scopes=SCOPES, ttl=5, notices=own_notices, timing=HoldTiming(clock_step=0),
                      callbacks=HoldCallbacks(on_event=on_event)) as held:
                began, before = time.monotonic(), counted[0]  # the wait's read is not one
                send_flood(forger, own_notices.channel, [identity], FLOOD, held.lease.epoch)
                flood_heard()
                assert held.wait_lost(max(0.0, began + 6 - time.monotonic())) is None
                window = time.monotonic() - began
                loads[0] = counted[0] - before
                assert held.lost is None and held.issue_grant(scopes=SCOPES, ttl=1).ok
        else:
            async def run() -> tuple[float, float]:
                store = AsyncPostgresLeaseStore(pg_dsn)
                try:
                    counted = count_loads(store)
                    gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
                    async with hold(gateway, identity, "c1", scopes=SCOPES, ttl=5,
                                    notices=own_notices, timing=HoldTiming(clock_step=0),
                                    callbacks=HoldCallbacks(on_event=on_event)) as held:
                        began, before = time.monotonic(), counted[0]
                        await asyncio.to_thread(send_flood, forger, own_notices.channel,
                                                [identity], FLOOD, held.lease.epoch)
                        await asyncio.to_thread(flood_heard)
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(held.wait_lost(),
                                                   max(0.0, began + 6 - time.monotonic()))
                        assert held.lost is None
                        window = time.monotonic() - began
                        loads[0] = counted[0] - before
                        assert (await held.issue_grant(scopes=SCOPES, ttl=1)).ok
                        return began, window
                finally:
                    await store.aclose()

            began, window = asyncio.run(run())
    # Held for 6 s; reads within the bound over those 6 s, whatever came.
    assert loads[0] <= turn_bound(confirmer.rate, confirmer.burst, window)
    assert len(renewals) >= 2 and max(renewals) < 1.0  # every ~1.7 s, none held up
    [(heard_at, then)] = at_heard
    assert heard.count >= FLOOD, f"the listener took in {heard.count} of {FLOOD} in 5 s"
    check_turns(confirmer, then, heard_at - began, loads[0])
    assert len(flood_warnings(caplog)) == 1


def check_turns(confirmer: NoticeConfirmer, then: NoticeStats, seconds: float,
                reads: int) -> None:
    """The bound over the ``seconds`` the listener took to hear the flood (about 2 s: some
    40 turns); after it, the turn queued behind the one running, and one for the last
    notice handed over; one read per turn."""
    assert then.confirmations <= turn_bound(confirmer.rate, confirmer.burst, seconds) + 1
    stats = confirmer.stats()
    assert reads == stats.confirmations <= then.confirmations + 2
    assert stats.notices == FLOOD and stats.held_back >= 1
    assert stats.coalesced >= FLOOD - 2 * stats.confirmations


def test_a_flood_of_forged_notices_keeps_a_waiter_polling_and_a_real_release_still_wakes_it(
        pg_dsn: str, pg_admin: psycopg.Connection[Any], pg_stores: StoreFactory,
        pg_tenant: str, own_notices: LeaseNotices, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mos_lease.notices")
    identity = LeaseIdentity(pg_tenant, "waiter", "b1")
    owner = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    lease = owner.acquire(identity, "c1", scopes=SCOPES, ttl=30).lease
    assert lease is not None
    store = pg_stores()
    loads = count_loads(store)
    seen, started = threading.Event(), threading.Event()
    acquired_at: list[float] = []

    def on_started(_lease: object) -> None:
        acquired_at.append(time.monotonic())
        started.set()

    def wait_for_it() -> None:
        # Pauses of 10 s: any read beyond the first few is a notice's doing.
        with hold(ConnectorLeaseCoordinator(store, AllowAllPolicy()), identity, "c2",
                  scopes=SCOPES, ttl=30, wait=30, notices=own_notices,
                  timing=HoldTiming(clock_step=0, min_backoff=10, max_backoff=10),
                  callbacks=HoldCallbacks(on_new_holder=lambda *_: seen.set(),
                                          on_started=on_started)):
            pass

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    try:
        assert seen.wait(5)
        time.sleep(0.2)  # into its 10 s pause
        before = loads[0]
        heard = Heard(own_notices, identity)
        with unprivileged_login(pg_admin, pg_dsn) as forger:
            began = time.monotonic()
            send_flood(forger, own_notices.channel, [identity], FLOOD, lease.epoch)
            all_heard = heard.all(FLOOD)
        confirmer = own_notices.confirmer
        stats = confirmer.stats()
        # One read per wake-up, the wake-ups within the bound, and the waiter still waiting.
        assert loads[0] - before <= turn_bound(confirmer.rate, confirmer.burst,
                                               all_heard - began) + 2
        assert stats.confirmations >= 1 and not started.is_set()
        time.sleep(0.2)  # the flood over: the turns left have run
        assert owner.release(lease).ok  # a real notice, right after the flood
        released = time.monotonic()
        assert started.wait(FAST) and acquired_at[0] - released < FAST
    finally:
        waiter.join(5)
    assert not waiter.is_alive()
    assert len(flood_warnings(caplog)) == 1
