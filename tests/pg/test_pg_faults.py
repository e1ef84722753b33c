"""Lost connections, unknown commit outcomes, timeouts and an unreachable database.

The fault proxy (``tests.pg_support.FaultProxy``) sits between a store and the server and
loses a connection at a chosen moment: after the server ran a write (it committed, the
client never heard) or before the server saw it (nothing happened). The coordinator must
report the truth either way, apply a takeover once and leave exactly one audit row.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    CommitOutcomeUnknown,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    LeaseResult,
    Reason,
    StoreUnavailable,
)
from mos_lease.ids import uuid7
from mos_lease.records import AuditEntry
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import AsyncPostgresLeaseStore, ConnectionSettings, PostgresLeaseStore
from tests.pg_fixtures import StoreFactory
from tests.pg_support import FaultProxy, unique_name

pytestmark = [pytest.mark.pg, pytest.mark.faults]

# The markers find each write in the protocol stream (statements are sent as text).
MARKERS = {"acquire": b"ON CONFLICT (tenant_id", "heartbeat": b"SET heartbeat_at",
           "takeover": b"epoch = l.epoch + 1"}
UNPREPARED = ConnectionSettings(prepare=False)


def _audit(store: PostgresLeaseStore, identity: LeaseIdentity) -> list[tuple[str, str, int | None]]:
    return [(r.entry.event.value, r.entry.outcome.value, r.entry.epoch)
            for r in store.audit(identity)]


def _operation(coordinator: ConnectorLeaseCoordinator, identity: LeaseIdentity,
               name: str) -> Callable[[], LeaseResult]:
    """Set up ``identity`` so that ``name`` will succeed, and return the call doing it."""
    if name == "acquire":
        return lambda: coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
    first = coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
    assert first.lease is not None
    lease = first.lease
    if name == "heartbeat":
        return lambda: coordinator.heartbeat(lease, ttl=60)
    return lambda: coordinator.takeover(identity, "c2", scopes=["tool:run"], ttl=30,
                                        expected_epoch=1)


EXPECTED_ROW = {"acquire": ("acquire", "acquired", 1), "heartbeat": ("heartbeat", "renewed", 1),
                "takeover": ("takeover", "taken_over", 2)}


@attrs.frozen
class _Cut:
    """One operation run through the proxy while it loses the request or the reply."""

    identity: LeaseIdentity
    coordinator: ConnectorLeaseCoordinator
    observer: PostgresLeaseStore  # a direct store, to look at what committed
    result: LeaseResult


def _run_cut(name: str, cut: Callable[[bytes], None], proxy: FaultProxy,
             pg_stores: StoreFactory, pg_tenant: str, caplog: pytest.LogCaptureFixture) -> _Cut:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    coordinator = ConnectorLeaseCoordinator(pg_stores(proxy.dsn, settings=UNPREPARED),
                                            AllowAllPolicy())
    operation = _operation(coordinator, identity, name)
    cut(MARKERS[name])
    with caplog.at_level(logging.WARNING, logger="mos_lease"):
        result = operation()
    return _Cut(identity, coordinator, pg_stores(), result)


@pytest.mark.parametrize("name", ["acquire", "heartbeat", "takeover"])
def test_reply_lost_after_commit_is_reconciled_as_committed(
        name: str, proxy: FaultProxy, pg_stores: StoreFactory, pg_tenant: str,
        caplog: pytest.LogCaptureFixture) -> None:
    run = _run_cut(name, proxy.cut_reply_to, proxy, pg_stores, pg_tenant, caplog)
    identity, coordinator, observer, result = (run.identity, run.coordinator, run.observer,
                                               run.result)
    assert "committed=True" in caplog.text
    assert result.ok and result.reconciled and result.lease is not None
    row = observer.load(identity).row
    assert row is not None
    assert (row.epoch, row.lease_id, row.connector_id) == (
        result.lease.epoch, result.lease.lease_id, result.lease.connector_id)
    assert _audit(observer, identity).count(EXPECTED_ROW[name]) == 1
    # The reconciled handle is the real one: the holder carries on.
    assert coordinator.heartbeat(result.lease, ttl=30).ok


@pytest.mark.parametrize("name", ["acquire", "heartbeat", "takeover"])
def test_request_lost_before_the_server_is_reconciled_as_not_committed(
        name: str, proxy: FaultProxy, pg_stores: StoreFactory, pg_tenant: str,
        caplog: pytest.LogCaptureFixture) -> None:
    run = _run_cut(name, proxy.cut_request, proxy, pg_stores, pg_tenant, caplog)
    identity, observer, result = run.identity, run.observer, run.result
    # Not committed, so the coordinator reread and wrote again (the same event id): the
    # write happened exactly once.
    assert "committed=False" in caplog.text
    assert result.ok and result.lease is not None
    assert _audit(observer, identity).count(EXPECTED_ROW[name]) == 1
    row = observer.load(identity).row
    assert row is not None and row.epoch == result.lease.epoch == EXPECTED_ROW[name][2]


def _backend_pid(admin: psycopg.Connection[Any], application: str, *,
                 waiting: bool = False) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            " AND (NOT %s OR wait_event_type = 'Lock')", (application, waiting)).fetchone()
        if found is not None:
            return int(found[0])
        time.sleep(0.01)
    raise AssertionError(f"no backend for {application} (waiting={waiting})")


def test_write_killed_while_waiting_on_a_row_lock(pg_dsn: str, pg_stores: StoreFactory,
                                                  pg_admin: psycopg.Connection[Any],
                                                  pg_tenant: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    application = unique_name("victim")
    store = pg_stores(settings=ConnectionSettings(application_name=application))
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    assert coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30).ok
    results: list[LeaseResult] = []
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("SELECT 1 FROM mos_lease.logical_agent_connector_leases WHERE tenant_id = %s"
                       " FOR UPDATE", (pg_tenant,))
        worker = threading.Thread(target=lambda: results.append(coordinator.takeover(
            identity, "c2", scopes=["tool:run"], ttl=30, expected_epoch=1)))
        with caplog.at_level(logging.WARNING, logger="mos_lease"):
            worker.start()
            pid = _backend_pid(pg_admin, application, waiting=True)
            pg_admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            time.sleep(0.05)
            locker.rollback()  # the settling read waits for this lock, then looks
            worker.join(timeout=20)
    assert not worker.is_alive()
    assert "committed=False" in caplog.text
    [result] = results
    assert result.ok and result.lease is not None and result.lease.epoch == 2
    assert _audit(store, identity).count(("takeover", "taken_over", 2)) == 1


def test_database_unreachable(proxy: FaultProxy, pg_stores: StoreFactory,
                              pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    coordinator = ConnectorLeaseCoordinator(pg_stores(proxy.dsn, settings=UNPREPARED),
                                            AllowAllPolicy())
    acquired = coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
    assert acquired.lease is not None
    granted = coordinator.issue_grant(acquired.lease, scopes=["tool:run"], ttl=10)
    assert granted.grant is not None
    assert coordinator.validate(granted.grant, identity=identity, scopes=["tool:run"]).ok
    proxy.refuse()
    # A write sent on the now dead connection: its outcome cannot be established yet...
    with pytest.raises(CommitOutcomeUnknown) as unknown:
        coordinator.heartbeat(acquired.lease, ttl=30)
    # Validation fails closed with its own reason; nothing is cached.
    denied = coordinator.validate(granted.grant, identity=identity, scopes=["tool:run"])
    assert denied.reason is Reason.STORE_UNAVAILABLE and denied.context is None
    with pytest.raises(StoreUnavailable, match="cannot connect"):
        coordinator.issue_grant(acquired.lease, scopes=["tool:run"], ttl=10)
    # ...but it can be later, from anywhere, by its event id.
    later = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    assert later.reconcile(identity, unknown.value.event_id) is False


def test_nothing_listening_is_store_unavailable(pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores("host=127.0.0.1 port=1 user=postgres dbname=postgres connect_timeout=2")
    with pytest.raises(StoreUnavailable, match="cannot connect"):
        store.load(LeaseIdentity(pg_tenant, "a", "b"))
    with pytest.raises(StoreUnavailable):
        ConnectorLeaseCoordinator(store, AllowAllPolicy()).acquire(
            LeaseIdentity(pg_tenant, "a", "b"), "c1", scopes=[], ttl=5)


def test_store_recovers_after_its_backend_is_killed(pg_stores: StoreFactory,
                                                    pg_admin: psycopg.Connection[Any],
                                                    pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    application = unique_name("recover")
    store = pg_stores(settings=ConnectionSettings(application_name=application))
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    result = coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
    assert result.lease is not None
    pg_admin.execute("SELECT pg_terminate_backend(%s)", (_backend_pid(pg_admin, application),))
    # A read resends once on a fresh connection.
    assert store.load(identity).row is not None
    pg_admin.execute("SELECT pg_terminate_backend(%s)", (_backend_pid(pg_admin, application),))
    # A write on the dead connection is reconciled (not committed) and then applied.
    renewed = coordinator.heartbeat(result.lease, ttl=30)
    assert renewed.ok
    assert _audit(store, identity).count(("heartbeat", "renewed", 1)) == 1


@pytest.mark.parametrize("timeouts", [
    {"lock_timeout": timedelta(milliseconds=100)},
    {"lock_timeout": None, "statement_timeout": timedelta(milliseconds=150)},
])
def test_timeouts_surface_as_store_unavailable_and_change_nothing(
        timeouts: dict[str, Any], pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    store = pg_stores(settings=ConnectionSettings(**timeouts))
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    result = coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
    assert result.lease is not None
    before = store.load(identity).row
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("SELECT 1 FROM mos_lease.logical_agent_connector_leases WHERE tenant_id = %s"
                       " FOR UPDATE", (pg_tenant,))
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"55P03|57014"):
            coordinator.heartbeat(result.lease, ttl=30)
        assert time.monotonic() - started < 3
        locker.rollback()
    assert store.load(identity).row == before
    assert _audit(store, identity) == [("acquire", "acquired", 1)]


@pytest.mark.parametrize("lose", ["reply", "request"])
def test_a_lost_batch_is_reconciled_lease_by_lease(lose: str, proxy: FaultProxy,
                                                   pg_stores: StoreFactory, pg_tenant: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    coordinator = ConnectorLeaseCoordinator(pg_stores(proxy.dsn, settings=UNPREPARED),
                                            AllowAllPolicy())
    observer = pg_stores()
    identities = [LeaseIdentity(pg_tenant, "agent", f"b{i}") for i in range(3)]
    handles = []
    for identity in identities:
        acquired = coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
        assert acquired.lease is not None
        handles.append(acquired.lease)
    if lose == "reply":
        proxy.cut_reply_to(MARKERS["heartbeat"])
    else:
        proxy.cut_request(MARKERS["heartbeat"])
    with caplog.at_level(logging.WARNING, logger="mos_lease"):
        results = coordinator.heartbeat_many(handles, ttl=60)
    assert all(result.ok for result in results)
    assert caplog.text.count(f"committed={lose == 'reply'}") == len(identities)
    for identity in identities:
        assert _audit(observer, identity).count(("heartbeat", "renewed", 1)) == 1


def test_an_audit_append_lost_after_its_commit_is_unknown_when_it_cannot_be_resent(
        proxy: FaultProxy, pg_stores: StoreFactory, pg_tenant: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A denial's audit row commits, its reply is lost, and neither the store's resend nor
    # the coordinator's can connect: the row exists, so "nothing changed" (StoreUnavailable)
    # would be false. The acquire it refused never happened, which reconcile answers.
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    direct = pg_stores()
    holder = ConnectorLeaseCoordinator(direct, AllowAllPolicy())
    assert holder.acquire(identity, "c1", scopes=["tool:run"], ttl=30).ok
    store = pg_stores(proxy.dsn, settings=UNPREPARED)
    rival = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    assert rival.acquire(identity, "c2", scopes=["tool:run"], ttl=30).reason is Reason.LEASE_HELD
    # Reconnecting from now on finds nothing listening.
    monkeypatch.setattr(store._source, "_conninfo",
                        "host=127.0.0.1 port=1 user=postgres dbname=postgres")
    proxy.cut_reply_to(b"mos_lease_record_audit(")
    with pytest.raises(CommitOutcomeUnknown) as unknown:
        rival.acquire(identity, "c2", scopes=["tool:run"], ttl=30)
    assert holder.reconcile(identity, unknown.value.event_id) is False
    denials = [row for row in _audit(direct, identity) if row[0] == "acquire"]
    assert denials.count(("acquire", "denied", None)) == 2, denials


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_record_whose_id_is_taken_and_cannot_be_checked_is_unknown(
        pg_stores: StoreFactory, pg_dsn: str, pg_tenant: str,
        monkeypatch: pytest.MonkeyPatch, flavour: str) -> None:
    # The first attempt of a record committed (its reply was lost), the resend finds its
    # event id taken, and the check that the row is this record cannot run: the row is in
    # the log, so "nothing changed" (StoreUnavailable) would be false.
    store = pg_stores()
    entry = AuditEntry(uuid7(), LifecycleEvent.ACQUIRE, Outcome.DENIED, Reason.LEASE_HELD,
                       LeaseIdentity(pg_tenant, "agent", "rec"), "c1", None, "corr")
    store.record(entry)

    def refusing(run: Callable[..., Any]) -> Callable[..., Any]:
        def patched(call: Any, **kwargs: Any) -> Any:
            if call.what == "audit record check":
                raise StoreUnavailable("connection refused")
            return run(call, **kwargs)
        return patched

    if flavour == "sync":
        monkeypatch.setattr(store, "_run", refusing(store._run))
        with pytest.raises(CommitOutcomeUnknown) as unknown:
            store.record(entry)
    else:
        async def resend() -> None:
            async with AsyncPostgresLeaseStore(pg_dsn) as async_store:
                real = async_store._run

                async def patched(call: Any, **kwargs: Any) -> Any:
                    if call.what == "audit record check":
                        raise StoreUnavailable("connection refused")
                    return await real(call, **kwargs)

                monkeypatch.setattr(async_store, "_run", patched)
                await async_store.record(entry)

        with pytest.raises(CommitOutcomeUnknown) as unknown:
            asyncio.run(resend())
    assert unknown.value.event_id == entry.event_id
    assert [r.entry.event_id for r in pg_stores().audit(entry.identity)] == [entry.event_id]
