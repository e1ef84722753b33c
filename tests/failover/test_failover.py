"""A primary with a synchronous standby: the two commit hazards, the first-use check, and a
store that follows the primary across a failover.

Hazard 1: ``statement_timeout`` does not end a commit's wait for a synchronous standby that
is gone; only the store's client-side bound does, and the write is then in doubt. Hazard 2:
a cancelled wait returns success with only a WARNING (SQLSTATE 01000): the write committed
locally and may vanish in the next failover. The library turns both into
``CommitOutcomeUnknown`` and, with ``require_synchronous_replication``, reconciles such a
write as committed only once it is durable on the standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    CommitOutcomeUnknown,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    StoreUnavailable,
)
from mos_lease.ids import uuid7
from mos_lease.machine import Renew
from mos_lease.records import AuditEntry
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import (
    AsyncPostgresLeaseStore,
    ConnectionSettings,
    PostgresLeaseStore,
    connect_kwargs,
    make_pool,
    replication,
)
from mos_lease_pg.sql_files import Statement
from mos_lease_pg.statements import Call, Kind
from tests.failover.cluster import ReplicatedPair
from tests.failover.support import (
    CALL_TIMEOUT,
    CancelWhenWaiting,
    ha_settings,
    migrated,
    store,
)
from tests.pg_support import with_params

SCOPES = ("tool:run",)
AUDIT = "mos_lease.connector_lease_audit_log"
# How late a bounded call may return: the watchdog's tick and the cancel's own round trip.
SLACK = 1.0


def held_lease(dsn: str, identity: LeaseIdentity) -> tuple[Renew, AuditEntry]:
    """Acquire ``identity`` through a store of its own; a heartbeat write of that lease and
    its audit entry, ready to send."""
    with store(dsn) as setup:
        acquired = ConnectorLeaseCoordinator(setup, AllowAllPolicy()).acquire(
            identity, "c1", scopes=SCOPES, ttl=60)
    assert acquired.ok and acquired.lease is not None
    lease = acquired.lease
    entry = AuditEntry(uuid7(), LifecycleEvent.HEARTBEAT, Outcome.RENEWED, None, identity,
                       "c1", lease.epoch, "failover-test")
    return Renew(identity, "c1", lease.lease_id, lease.epoch, timedelta(seconds=60)), entry


def audited(node_dsn: str, event_id: UUID) -> bool:
    with psycopg.connect(node_dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {AUDIT} WHERE event_id = %s",
                           (event_id,)).fetchone()
    assert row is not None
    return bool(row[0])


def run_raw(conn: psycopg.Connection[Any], call: Call[Any]) -> Any:
    """Send a store call on a raw connection, as the store's ``_run`` does."""
    return call.parse(conn.execute(call.statement.text, call.params).fetchall())


def a_write(event_id: UUID) -> Call[None]:
    return Call("test write", Statement.of("t", "INSERT INTO t VALUES (1)"), {},
                lambda rows: None, Kind.WRITE, event_id)


# --- hazard 2: a cancelled synchronous-replication wait reports success ---------------------


def test_cancelled_sync_wait_reports_success_and_the_hook_makes_it_unknown(
        pair: ReplicatedPair) -> None:
    dsn = pair.create_database("hazard2")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (x int)")
        replication.watch(conn)
        conn.execute("INSERT INTO t VALUES (1)")
        replication.confirm(conn, [a_write(uuid4())])  # standby up: confirmed, no raise
    pair.stop_standby()
    with psycopg.connect(dsn, autocommit=True, application_name="hazard2") as conn:
        seen: list[tuple[str | None, str | None]] = []
        conn.add_notice_handler(lambda d: seen.append((d.sqlstate, d.message_detail)))
        replication.watch(conn)
        canceller = CancelWhenWaiting(pair.primary.dsn("hazard2"), "hazard2")
        cur = conn.execute("INSERT INTO t VALUES (2)")
        assert canceller.join(), "the INSERT never waited for the standby"
        # What a plain client sees: success, and the warning as a notice (SQLSTATE 01000).
        assert cur.statusmessage == "INSERT 0 1"
        assert seen and seen[0][0] == "01000"
        assert "committed locally" in (seen[0][1] or "")
        event_id = uuid4()
        with pytest.raises(CommitOutcomeUnknown, match="01000") as raised:
            replication.confirm(conn, [a_write(event_id)])
        assert raised.value.event_id == event_id
        # Only once: the flag belongs to the statement that raised it.
        replication.confirm(conn, [a_write(uuid4())])
        # A read that carried the warning is not a success either.
        replication.watch(conn)
        canceller = CancelWhenWaiting(pair.primary.dsn("hazard2"), "hazard2")
        run_raw(conn, replication.durability_barrier())
        assert canceller.join()
        with pytest.raises(StoreUnavailable, match="outcome stays unknown"):
            replication.confirm(conn, [replication.durability_barrier()])


def test_store_write_whose_sync_wait_is_cancelled_is_unknown(pair: ReplicatedPair) -> None:
    dsn = migrated(pair)
    identity = LeaseIdentity("t-cancel", "agent", "b")
    write, entry = held_lease(dsn, identity)
    pair.stop_standby()
    with store(dsn, call_timeout=15.0, statement_timeout=timedelta(seconds=10)) as ha:
        ha.load(identity)  # connected and checked before the standby question arises
        canceller = CancelWhenWaiting(pair.primary.dsn(), "failover-store")
        with pytest.raises(CommitOutcomeUnknown) as raised:
            ha.apply(write, entry)
        assert canceller.join()
        assert raised.value.event_id == entry.event_id


def test_audit_append_whose_sync_wait_is_cancelled_is_unknown(pair: ReplicatedPair) -> None:
    """An audit append (a grant issue's, a refusal's) is an idempotent write: committed
    locally, it may survive the failover, so "nothing changed" would be a false answer."""
    dsn = migrated(pair)
    identity = LeaseIdentity("t-cancel-append", "agent", "b")
    _, entry = held_lease(dsn, identity)
    pair.stop_standby()
    with store(dsn, call_timeout=15.0, statement_timeout=timedelta(seconds=10)) as ha:
        ha.load(identity)
        canceller = CancelWhenWaiting(pair.primary.dsn(), "failover-store")
        with pytest.raises(CommitOutcomeUnknown) as raised:
            ha.record(entry)
        assert canceller.join()
        assert raised.value.event_id == entry.event_id
    assert audited(pair.primary.dsn(_dbname(dsn)), entry.event_id)  # committed locally


# --- hazard 1: no standby, the commit waits forever on the server ---------------------------


def test_durability_barrier_waits_for_the_standby_and_needs_one(pair: ReplicatedPair) -> None:
    """The reconcile check: passes at once with the standby up, is flagged when its wait is
    cut off, and refuses outright when no synchronous standby is configured."""
    with psycopg.connect(pair.primary.dsn(), autocommit=True,
                         application_name="barrier") as conn:
        replication.watch(conn)
        began = time.monotonic()
        run_raw(conn, replication.durability_barrier())
        assert time.monotonic() - began < 1.0
        replication.confirm(conn, [replication.durability_barrier()])
        pair.stop_standby()
        canceller = CancelWhenWaiting(pair.primary.dsn(), "barrier", timeout=10)
        replication.watch(conn)
        run_raw(conn, replication.durability_barrier())  # returns only once cancelled
        assert canceller.join(), "the barrier did not wait for the missing standby"
        with pytest.raises(StoreUnavailable):
            replication.confirm(conn, [replication.durability_barrier()])
        pair.start_standby()
        pair.set_synchronous(False)
        with pytest.raises(StoreUnavailable, match="no synchronous standby"):
            run_raw(conn, replication.durability_barrier())


def test_write_without_standby_ends_within_the_call_bound(pair: ReplicatedPair) -> None:
    """The server alone would wait forever (statement_timeout does not apply); the store's
    bound ends the call, and the write is committed locally only."""
    dsn = migrated(pair)
    identity = LeaseIdentity("t-bound", "agent", "b")
    write, entry = held_lease(dsn, identity)
    pair.stop_standby()
    with store(dsn) as ha:
        ha.load(identity)

        def send() -> None:
            # Without the store hook the watchdog's own cancel can make this a reported
            # success (hazard 2); the outcome is asserted by the test below, the bound here.
            with contextlib.suppress(CommitOutcomeUnknown):
                ha.apply(write, entry)

        # In a thread, so that a store without the bound fails this test instead of hanging.
        sender = threading.Thread(target=send, daemon=True)
        began = time.monotonic()
        sender.start()
        sender.join(timeout=CALL_TIMEOUT + SLACK + 10)
        elapsed = time.monotonic() - began
        assert not sender.is_alive(), "the write is still waiting for the standby"
    assert elapsed < CALL_TIMEOUT + SLACK, f"the write took {elapsed:.2f} s"
    assert audited(pair.primary.dsn(_dbname(dsn)), entry.event_id)  # committed locally


def test_write_without_standby_is_unknown_and_never_reconciled_committed(
        pair: ReplicatedPair) -> None:
    dsn = migrated(pair)
    identity = LeaseIdentity("t-reconcile", "agent", "b")
    write, entry = held_lease(dsn, identity)
    pair.stop_standby()
    with store(dsn) as ha:
        ha.load(identity)
        began = time.monotonic()
        with pytest.raises(CommitOutcomeUnknown):
            ha.apply(write, entry)
        assert time.monotonic() - began < CALL_TIMEOUT + SLACK
        began = time.monotonic()
        with pytest.raises(StoreUnavailable):
            ha.event_committed(entry.event_id)
        assert time.monotonic() - began < CALL_TIMEOUT + SLACK
    # The event is there, but only on the primary: "committed" would have been a guess.
    assert audited(pair.primary.dsn(_dbname(dsn)), entry.event_id)


def _dbname(dsn: str) -> str:
    from psycopg.conninfo import conninfo_to_dict

    return str(conninfo_to_dict(dsn)["dbname"])


# --- the first-use check --------------------------------------------------------------------


def _first_call(dsn: str, **overrides: Any) -> None:
    with store(dsn, **overrides) as ha:
        ha.leases("t-none")


def test_require_sync_passes_on_the_synchronous_pair_and_logs_the_facts(
        pair: ReplicatedPair, caplog: pytest.LogCaptureFixture) -> None:
    dsn = migrated(pair)
    with caplog.at_level(logging.INFO, logger="mos_lease_pg"):
        _first_call(dsn)
    facts = [r.getMessage() for r in caplog.records if "synchronous_commit=" in r.getMessage()]
    assert len(facts) == 1, facts
    assert "primary" in facts[0] and "synchronous_commit=on" in facts[0]
    assert "synchronous_standby_names='nodeb'" in facts[0]


def test_require_sync_refuses_a_primary_without_a_synchronous_standby(
        pair: ReplicatedPair) -> None:
    dsn = migrated(pair)
    pair.set_synchronous(False)
    with pytest.raises(ConfigurationError, match="synchronous_standby_names is empty"):
        _first_call(dsn)
    _first_call(dsn, require_synchronous_replication=False)  # the default accepts it


@pytest.mark.parametrize("level", ["local", "off", "remote_write"])
def test_require_sync_refuses_commits_that_do_not_wait(pair: ReplicatedPair,
                                                       level: str) -> None:
    dsn = with_params(migrated(pair), options=f"-c synchronous_commit={level}")
    with pytest.raises(ConfigurationError, match=f"synchronous_commit is '{level}'"):
        _first_call(dsn)


def test_a_store_on_the_standby_refuses_to_start(pair: ReplicatedPair) -> None:
    dsn = migrated(pair)
    pair.replayed()
    standby = pair.standby.dsn(_dbname(dsn))
    for settings in ({}, {"require_synchronous_replication": False}):
        with pytest.raises(ConfigurationError, match="connected to a standby"):
            _first_call(standby, **settings)

    async def first_async_call() -> None:
        async with AsyncPostgresLeaseStore(standby, settings=ha_settings()) as ha:
            await ha.leases("t-none")

    with pytest.raises(ConfigurationError, match="connected to a standby"):
        asyncio.run(first_async_call())
    # Allowed for reads on purpose: reads work, a write is refused by the server and
    # changes nothing.
    with store(standby, standby_reads=True) as reader:
        assert reader.leases("t-none") == []
        coordinator = ConnectorLeaseCoordinator(reader, AllowAllPolicy())
        with pytest.raises(StoreUnavailable, match="read-only"):
            coordinator.acquire(LeaseIdentity("t-ro", "agent", "b"), "c1", scopes=SCOPES,
                                ttl=60)
    with psycopg.connect(pair.primary.dsn(_dbname(dsn)), autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {AUDIT} WHERE tenant_id = 't-ro'").fetchone()
    assert row == (0,)


def test_multi_host_dsn_gets_read_write_sessions() -> None:
    settings = ConnectionSettings()
    multi = "host=a,b port=1,2 dbname=x"
    assert connect_kwargs(multi, settings)["target_session_attrs"] == "read-write"
    assert connect_kwargs("postgresql://a:1,b:2/x", settings)["target_session_attrs"] == (
        "read-write")
    assert "target_session_attrs" not in connect_kwargs("host=a port=1 dbname=x", settings)
    chosen = connect_kwargs(multi + " target_session_attrs=any", settings)
    assert "target_session_attrs" not in chosen  # the DSN's own choice stays
    reads = ConnectionSettings(standby_reads=True)
    assert "target_session_attrs" not in connect_kwargs(multi, reads)
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigurationError):
            ConnectionSettings(require_synchronous_replication=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError):
            ConnectionSettings(standby_reads=bad)  # type: ignore[arg-type]


def test_multi_host_dsn_listing_the_standby_first_lands_on_the_primary(
        pair: ReplicatedPair) -> None:
    name = _dbname(migrated(pair))
    standby_first = (f"host=127.0.0.1,127.0.0.1 port={pair.standby.port},{pair.primary.port} "
                     f"user=postgres dbname={name}")
    identity = LeaseIdentity("t-order", "agent", "b")
    with store(standby_first) as ha:
        acquired = ConnectorLeaseCoordinator(ha, AllowAllPolicy()).acquire(
            identity, "c1", scopes=SCOPES, ttl=60)
    assert acquired.ok


# --- failover: the same store follows the primary, and judges it again ------------------------


def _audit_count(pair: ReplicatedPair, dsn: str, tenant: str) -> int:
    with psycopg.connect(pair.primary.dsn(_dbname(dsn)), autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {AUDIT} WHERE tenant_id = %s",
                           (tenant,)).fetchone()
    assert row is not None
    return int(row[0])


def _pooled_store(dsn: str) -> contextlib.AbstractContextManager[PostgresLeaseStore]:
    @contextlib.contextmanager
    def opened() -> Iterator[PostgresLeaseStore]:
        settings = ha_settings()
        with make_pool(dsn, settings, min_size=1, max_size=2) as pool, \
                PostgresLeaseStore(pool=pool, settings=settings) as ha:
            yield ha
    return opened()


@pytest.mark.parametrize("source", ["dedicated", "pool"])
def test_store_follows_the_primary_and_refuses_it_without_a_synchronous_standby(
        pair: ReplicatedPair, source: str) -> None:
    """After a failover the store reconnects to the new primary by itself, but with
    require_synchronous_replication it writes there only once a synchronous standby is
    attached: the new connection is judged again, not only the store's first."""
    dsn = migrated(pair)
    identity = LeaseIdentity(f"t-follow-{source}", "agent", "b")
    with (store(dsn) if source == "dedicated" else _pooled_store(dsn)) as ha:
        coordinator = ConnectorLeaseCoordinator(ha, AllowAllPolicy())
        acquired = coordinator.acquire(identity, "c1", scopes=SCOPES, ttl=60)
        assert acquired.ok and acquired.lease is not None
        old_port = pair.primary.port
        pair.fail_over()  # the new primary runs alone: synchronous_standby_names = ''
        assert pair.primary.port != old_port
        # The connections to the old primary fail first (a pool may hold max_size of
        # them; a read is sent again once on a dedicated one), then the new one is refused.
        seen: list[str] = []
        while not seen or "no synchronous standby" not in seen[-1]:
            assert len(seen) < 3, seen
            with pytest.raises(StoreUnavailable) as raised:
                ha.load(identity)
            seen.append(str(raised.value))
        for _ in range(3):  # every call, not only the first after the reconnect
            with pytest.raises(StoreUnavailable, match="no synchronous standby"):
                coordinator.heartbeat(acquired.lease, ttl=60)
        assert _audit_count(pair, dsn, identity.tenant_id) == 1  # nothing written there
        pair.rebuild_standby()
        snapshot = ha.load(identity)
        assert snapshot.row is not None and snapshot.row.epoch == 1
        beat = coordinator.heartbeat(acquired.lease, ttl=60)
        assert beat.ok, beat.reason
        taken = coordinator.takeover(identity, "c2", scopes=SCOPES, ttl=60, expected_epoch=1)
        assert taken.ok and taken.current_epoch == 2
    with psycopg.connect(pair.primary.dsn(_dbname(dsn)), autocommit=True) as conn:
        rows = conn.execute(f"SELECT event, outcome, epoch FROM {AUDIT} WHERE tenant_id = %s "
                            "ORDER BY seq", (identity.tenant_id,)).fetchall()
        assert not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]  # type: ignore[index]
    assert rows == [("acquire", "acquired", 1), ("heartbeat", "renewed", 1),
                    ("takeover", "taken_over", 2)]


def test_async_store_judges_its_new_connection_after_a_failover(pair: ReplicatedPair) -> None:
    dsn = migrated(pair)
    identity = LeaseIdentity("t-follow-async", "agent", "b")

    async def scenario() -> None:
        async with AsyncPostgresLeaseStore(dsn, settings=ha_settings()) as ha:
            assert (await ha.load(identity)).row is None
            pair.fail_over()
            with pytest.raises(StoreUnavailable, match="no synchronous standby"):
                await ha.load(identity)
            pair.rebuild_standby()
            assert (await ha.load(identity)).row is None

    asyncio.run(scenario())


def test_store_without_the_requirement_keeps_writing_on_a_lone_primary(
        pair: ReplicatedPair) -> None:
    dsn = migrated(pair)
    identity = LeaseIdentity("t-follow-plain", "agent", "b")
    with store(dsn, require_synchronous_replication=False) as plain:
        coordinator = ConnectorLeaseCoordinator(plain, AllowAllPolicy())
        acquired = coordinator.acquire(identity, "c1", scopes=SCOPES, ttl=60)
        assert acquired.ok and acquired.lease is not None
        pair.fail_over()
        beat = coordinator.heartbeat(acquired.lease, ttl=60)
        assert beat.ok, beat.reason
    assert _audit_count(pair, dsn, identity.tenant_id) == 2
