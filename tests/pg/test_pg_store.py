"""The store contract on a real server: every guarded write applied and refused, its audit
row appended in the same statement exactly when it applied, all judged by database time."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

import attrs
import psycopg
import psycopg_pool
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseIdentity,
    StoreUnavailable,
)
from mos_lease.identity import MAX_EPOCH
from mos_lease.ids import uuid7
from mos_lease.machine import Close, Insert, Renew, Rotate, Write, apply_write, write_outcome
from mos_lease.records import AuditEntry, LeaseRow, WriteOutcome
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore, connect_kwargs, make_pool
from tests.pg_clock import ShiftedPostgresLeaseStore
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

TTL = timedelta(seconds=30)
_EVENTS = {Insert: (LifecycleEvent.ACQUIRE, Outcome.ACQUIRED),
           Renew: (LifecycleEvent.HEARTBEAT, Outcome.RENEWED),
           Close: (LifecycleEvent.RELEASE, Outcome.RELEASED),
           Rotate: (LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER)}


def entry_for(write: Write) -> AuditEntry:
    event, outcome = _EVENTS[type(write)]
    epoch = (1 if isinstance(write, Insert) else write.expected_epoch + 1
             if isinstance(write, Rotate) else write.epoch)
    return AuditEntry(uuid7(), event, outcome, None, write.identity, write.connector_id, epoch,
                      f"corr-{uuid4().hex[:8]}")


def check(store: PostgresLeaseStore, write: Write, *, applies: bool) -> WriteOutcome:
    """Apply ``write`` and hold the store to the reference semantics and atomic audit."""
    before = store.load(write.identity)
    audited_before = len(store.audit(write.identity))
    entry = entry_for(write)
    outcome = store.apply(write, entry)
    assert outcome.now >= before.now
    reference = write_outcome(write, before.row, outcome.now)
    assert outcome.row == reference
    assert (outcome.row is not None) == applies, (write, before.row)
    assert store.load(write.identity).row == (reference if applies else before.row)
    assert store.event_committed(entry.event_id) == applies
    records = store.audit(write.identity)
    assert len(records) == audited_before + (1 if applies else 0)
    if applies:
        assert records[-1].entry == entry
        assert records[-1].recorded_at == outcome.now
    return outcome


def acquired(store: PostgresLeaseStore, identity: LeaseIdentity, connector: str = "c1",
             ttl: timedelta = TTL) -> LeaseRow:
    row = check(store, Insert(identity, uuid4(), connector, ("tool:run",), ttl),
                applies=True).row
    assert row is not None
    return row


def test_insert_is_insert_only(pg_store: PostgresLeaseStore, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    before = pg_store.now()
    row = acquired(pg_store, identity)
    assert row.epoch == 1 and row.released_at is None
    assert before <= row.acquired_at == row.heartbeat_at == row.updated_at <= pg_store.now()
    assert row.expires_at == row.acquired_at + TTL
    # Any existing row, active, released or expired, refuses a second insert.
    check(pg_store, Insert(identity, uuid4(), "c2", (), TTL), applies=False)
    check(pg_store, Close(identity, "c1", row.lease_id, 1), applies=True)
    check(pg_store, Insert(identity, uuid4(), "c2", (), TTL), applies=False)


def test_renew_and_close_need_the_full_match(pg_store: PostgresLeaseStore,
                                             pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    row = acquired(pg_store, identity)
    check(pg_store, Renew(identity, "c2", row.lease_id, 1, TTL), applies=False)
    check(pg_store, Renew(identity, "c1", uuid4(), 1, TTL), applies=False)
    check(pg_store, Renew(identity, "c1", row.lease_id, 2, TTL), applies=False)
    check(pg_store, Renew(LeaseIdentity(pg_tenant, "agent", "b2"), "c1", row.lease_id, 1, TTL),
          applies=False)
    renewed = check(pg_store, Renew(identity, "c1", row.lease_id, 1, timedelta(seconds=7.25)),
                    applies=True)
    assert renewed.row is not None
    assert renewed.row.expires_at == renewed.now + timedelta(seconds=7.25)
    check(pg_store, Close(identity, "c2", row.lease_id, 1), applies=False)
    check(pg_store, Close(identity, "c1", row.lease_id, 2), applies=False)
    closed = check(pg_store, Close(identity, "c1", row.lease_id, 1), applies=True)
    assert closed.row is not None and closed.row.released_at == closed.now
    assert closed.row.epoch == 1
    check(pg_store, Renew(identity, "c1", row.lease_id, 1, TTL), applies=False)
    check(pg_store, Close(identity, "c1", row.lease_id, 1), applies=False)


def test_expiry_is_judged_by_database_time(pg_store: ShiftedPostgresLeaseStore,
                                           pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    row = acquired(pg_store, identity, ttl=timedelta(seconds=10))
    pg_store.advance(timedelta(seconds=9))
    check(pg_store, Renew(identity, "c1", row.lease_id, 1, timedelta(seconds=10)), applies=True)
    pg_store.advance(timedelta(seconds=10))
    check(pg_store, Renew(identity, "c1", row.lease_id, 1, TTL), applies=False)
    check(pg_store, Close(identity, "c1", row.lease_id, 1), applies=False)
    # An expired lease may be taken over without preemption.
    taken = check(pg_store, Rotate(identity, 1, False, uuid4(), "c2", ("x",), TTL),
                  applies=True)
    assert taken.row is not None and taken.row.epoch == 2


def test_rotate_is_a_compare_and_set_on_the_epoch(pg_store: PostgresLeaseStore,
                                                  pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    check(pg_store, Rotate(identity, 1, True, uuid4(), "c2", (), TTL), applies=False)  # no row
    row = acquired(pg_store, identity)
    check(pg_store, Rotate(identity, 2, True, uuid4(), "c2", (), TTL), applies=False)
    check(pg_store, Rotate(identity, 1, False, uuid4(), "c2", (), TTL), applies=False)  # active
    new_id = uuid4()
    taken = check(pg_store, Rotate(identity, 1, True, new_id, "c2", ("a", "b"), TTL),
                  applies=True).row
    assert taken is not None
    assert (taken.epoch, taken.lease_id, taken.connector_id, taken.scopes) == (
        2, new_id, "c2", ("a", "b"))
    assert taken.acquired_at > row.acquired_at
    # The old holder is fenced out of every write.
    check(pg_store, Renew(identity, "c1", row.lease_id, 1, TTL), applies=False)
    check(pg_store, Rotate(identity, 1, True, uuid4(), "c1", (), TTL), applies=False)
    check(pg_store, Close(identity, "c2", new_id, 2), applies=True)
    reopened = check(pg_store, Rotate(identity, 2, False, uuid4(), "c3", (), TTL),
                     applies=True).row
    assert reopened is not None and reopened.epoch == 3 and reopened.released_at is None


def test_rotate_never_passes_the_bigint_maximum(pg_store: PostgresLeaseStore,
                                                pg_admin: psycopg.Connection[Any],
                                                pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    acquired(pg_store, identity)
    # Not a transition the schema permits (epochs rise by one): a superuser steps around
    # the triggers to reach the ceiling.
    with pg_admin.transaction():
        pg_admin.execute("SET LOCAL session_replication_role = replica")
        pg_admin.execute("UPDATE logical_agent_connector_leases SET epoch = %s"
                         " WHERE tenant_id = %s", (MAX_EPOCH, pg_tenant))
    check(pg_store, Rotate(identity, MAX_EPOCH, True, uuid4(), "c2", (), TTL), applies=False)
    row = pg_store.load(identity).row
    assert row is not None and row.epoch == MAX_EPOCH


def test_store_time_is_the_database_clock_plus_the_offset(pg_stores: StoreFactory,
                                                          pg_admin: psycopg.Connection[Any]
                                                          ) -> None:
    def db_now() -> Any:
        found = pg_admin.execute("SELECT clock_timestamp()").fetchone()
        assert found is not None
        return found[0]

    store = pg_stores(time_offset=timedelta(hours=1))
    low, seen, high = db_now(), store.now(), db_now()
    assert low + timedelta(hours=1) <= seen <= high + timedelta(hours=1)
    store.advance(90)
    low, seen, high = db_now(), store.now(), db_now()
    assert store.time_offset == timedelta(hours=1, seconds=90)
    assert low + store.time_offset <= seen <= high + store.time_offset
    with pytest.raises(ValueError):
        store.advance(timedelta(seconds=-1))
    with pytest.raises(ConfigurationError):
        pg_stores(time_offset=5)


def test_the_production_store_reads_the_database_clock_as_it_is(pg_dsn: str) -> None:
    # The clock offset is a test double's: the production store has no way to move it.
    with pytest.raises(TypeError):
        PostgresLeaseStore(pg_dsn, time_offset=timedelta(hours=1))  # type: ignore[call-arg]
    with PostgresLeaseStore(pg_dsn) as store:
        assert not hasattr(store, "advance") and not hasattr(store, "time_offset")


def test_records_are_appended_once(pg_store: PostgresLeaseStore, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    denial = AuditEntry(uuid7(), LifecycleEvent.ACQUIRE, Outcome.DENIED, Reason.LEASE_HELD,
                        identity, "c2", None, "corr")
    assert not pg_store.event_committed(denial.event_id)
    before = pg_store.now()
    pg_store.record(denial)
    pg_store.record(denial)  # a resend after a lost connection cannot log twice
    [record] = pg_store.audit(identity)
    assert record.entry == denial and before <= record.recorded_at <= pg_store.now()
    # Recorded, but a refusal's entry says its attempt took no effect: reconciling its event
    # id must not answer "committed" (mos_lease.reconciliation.took_effect).
    assert not pg_store.event_committed(denial.event_id)
    issued = AuditEntry(uuid7(), LifecycleEvent.GRANT_ISSUE, Outcome.GRANT_ISSUED, None,
                        identity, "c2", 1, "corr")
    pg_store.record(issued)
    assert pg_store.event_committed(issued.event_id)
    assert not pg_store.event_committed(uuid4())


def test_renew_many_guards_each_renewal_and_keeps_the_order(pg_store: PostgresLeaseStore,
                                                            pg_tenant: str) -> None:
    identities = [LeaseIdentity(pg_tenant, "agent", f"b{i}") for i in (3, 2, 1)]
    rows = [acquired(pg_store, identity) for identity in identities]
    pg_store.apply(Close(identities[2], "c1", rows[2].lease_id, 1),
                   entry_for(Close(identities[2], "c1", rows[2].lease_id, 1)))
    writes = [
        Renew(identities[0], "c1", rows[0].lease_id, 1, TTL),
        Renew(identities[1], "c1", uuid4(), 1, TTL),  # wrong lease: refused
        Renew(identities[2], "c1", rows[2].lease_id, 1, TTL),  # released: refused
    ]
    entries = [entry_for(w) for w in writes]
    before = [pg_store.load(w.identity).row for w in writes]
    outcomes = pg_store.renew_many(list(zip(writes, entries, strict=True)))
    assert [o.row is not None for o in outcomes] == [True, False, False]
    for write, entry, old, outcome in zip(writes, entries, before, outcomes, strict=True):
        assert outcome.row == write_outcome(write, old, outcome.now)
        assert pg_store.event_committed(entry.event_id) == (outcome.row is not None)
    assert pg_store.renew_many([]) == []
    one = [(Renew(identities[0], "c1", rows[0].lease_id, 1, TTL),
            entry_for(Renew(identities[0], "c1", rows[0].lease_id, 1, TTL)))]
    assert [o.row is not None for o in pg_store.renew_many(one)] == [True]  # a batch of one


@pytest.mark.parametrize("bad", ["close", "entry"])
def test_renew_many_refuses_anything_but_heartbeat_renewals(
        pg_store: PostgresLeaseStore, pg_tenant: str, bad: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "only-renewals")
    row = acquired(pg_store, identity)
    renew = Renew(identity, "c1", row.lease_id, 1, TTL)
    item: tuple[Any, AuditEntry] = (
        (Close(identity, "c1", row.lease_id, 1), entry_for(renew)) if bad == "close"
        else (renew, attrs.evolve(entry_for(renew), epoch=2)))
    before = list(pg_store.audit(identity))
    with pytest.raises(InvalidInput, match="renewals"):
        pg_store.renew_many([item])
    assert list(pg_store.audit(identity)) == before


def test_coordinator_heartbeat_many(pg_store: PostgresLeaseStore, pg_tenant: str) -> None:
    coordinator = ConnectorLeaseCoordinator(pg_store, AllowAllPolicy())
    handles = []
    for binding in ("b2", "b1", "b3"):
        result = coordinator.acquire(LeaseIdentity(pg_tenant, "agent", binding), "c1",
                                     scopes=["tool:run"], ttl=10)
        assert result.lease is not None
        handles.append(result.lease)
    released = coordinator.release(handles[1])
    assert released.ok
    results = coordinator.heartbeat_many(handles, ttl=20)
    assert [r.reason for r in results] == [None, Reason.LEASE_RELEASED, None]
    for handle, result in zip(handles, results, strict=True):
        if result.lease is not None:
            assert result.lease.lease_id == handle.lease_id
            assert result.lease.expires_at > handle.expires_at


def test_reference_semantics_hold_exactly(pg_store: PostgresLeaseStore, pg_tenant: str) -> None:
    # The row the store writes is the core's apply_write at the store's time, to the
    # microsecond, including fractional TTLs.
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    write = Insert(identity, uuid4(), "c1", ("b", "a:x"), timedelta(seconds=12, microseconds=7))
    outcome = pg_store.apply(write, entry_for(write))
    assert outcome.row == apply_write(write, None, outcome.now)


def test_inspection_views(pg_store: PostgresLeaseStore, pg_tenant: str) -> None:
    other = f"{pg_tenant}-other"
    for tenant, binding in ((pg_tenant, "b2"), (pg_tenant, "b1"), (other, "b1")):
        acquired(pg_store, LeaseIdentity(tenant, "agent", binding))
    mine = pg_store.leases(pg_tenant)
    assert [r.identity.binding_id for r in mine] == ["b1", "b2"]
    assert {r.identity.tenant_id for r in pg_store.leases()} >= {pg_tenant, other}
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    [first] = pg_store.audit(identity)
    assert pg_store.audit(identity, after_seq=first.seq) == []
    assert len(pg_store.search_audit(tenant_id=pg_tenant)) == 2
    assert len(pg_store.search_audit(tenant_id=pg_tenant, binding_id="b2", limit=1)) == 1
    seqs = [r.seq for r in pg_store.search_audit(tenant_id=pg_tenant)]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    bad_arguments: list[dict[str, Any]] = [
        {"limit": 0}, {"after_seq": -1}, {"limit": True}, {"identity": "t/a/b"}]
    for bad in bad_arguments:
        with pytest.raises(InvalidInput):
            pg_store.audit(**bad)
    with pytest.raises(InvalidInput):
        pg_store.leases("")
    with pytest.raises(InvalidInput):
        pg_store.search_audit(binding_id=" padded ")


def test_pooled_store(pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    settings = ConnectionSettings(pool_timeout=0.2)
    with make_pool(pg_dsn, settings, min_size=1, max_size=1) as pool:
        store = pg_stores(pool=pool, settings=settings)
        coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        result = coordinator.acquire(LeaseIdentity(pg_tenant, "a", "b"), "c1",
                                     scopes=["tool:run"], ttl=10)
        assert result.ok
        # An exhausted pool is a prompt StoreUnavailable, never a hang.
        held = pool.getconn()
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="pool exhausted"):
                store.load(LeaseIdentity(pg_tenant, "a", "b"))
            assert time.monotonic() - started < 2
        finally:
            pool.putconn(held)
        assert store.load(LeaseIdentity(pg_tenant, "a", "b")).row is not None
    with (psycopg_pool.ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool,
          pytest.raises(ConfigurationError, match="autocommit")):
        pg_stores(pool=pool).load(LeaseIdentity(pg_tenant, "a", "b"))


def test_store_options_are_checked(pg_dsn: str) -> None:
    with pytest.raises(ConfigurationError):
        PostgresLeaseStore()
    with make_pool(pg_dsn, min_size=1, max_size=1) as pool, pytest.raises(ConfigurationError):
        PostgresLeaseStore(pg_dsn, pool=pool)
    with pytest.raises(ConfigurationError):
        ConnectionSettings(statement_timeout=timedelta(0))
    with pytest.raises(ConfigurationError):
        ConnectionSettings(pool_timeout=0)
    with pytest.raises(ConfigurationError):
        connect_kwargs("host=127.0.0.1 nonsense", ConnectionSettings())


def test_timeouts_travel_as_startup_options(pg_dsn: str) -> None:
    settings = ConnectionSettings(statement_timeout=timedelta(milliseconds=1500),
                                  lock_timeout=timedelta(milliseconds=250))
    dsn = f"{pg_dsn} options='-c work_mem=8MB'"
    with psycopg.connect(dsn, **connect_kwargs(dsn, settings)) as conn:
        shown = [conn.execute(f"SHOW {name}").fetchone()
                 for name in ("statement_timeout", "lock_timeout", "work_mem")]
        assert conn.autocommit
    assert shown == [("1500ms",), ("250ms",), ("8MB",)]
    quiet = connect_kwargs(pg_dsn, ConnectionSettings(session_options=False))
    assert "options" not in quiet


def test_uuid_ids_round_trip(pg_store: PostgresLeaseStore, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    row = acquired(pg_store, identity)
    loaded = pg_store.load(identity).row
    assert loaded is not None and isinstance(loaded.lease_id, UUID)
    assert loaded == row


def test_closing_a_store_waits_for_a_call_in_flight_on_another_thread(
        pg_dsn: str, pg_store: PostgresLeaseStore, pg_tenant: str) -> None:
    """A store closed while another thread's call is on its connection (a call its caller
    gave up on, at a gateway's shutdown) closes once that call has ended, at most a call
    bound later: never under the statement, which libpq does not survive (a process abort
    was seen). The call gets its answer; the next call is refused as on a closed store."""
    identity = LeaseIdentity(pg_tenant, "agent", "in-flight")
    row = acquired(pg_store, identity)
    renew = Renew(identity, "c1", row.lease_id, row.epoch, TTL)
    answers: list[object] = []
    with psycopg.connect(pg_dsn, autocommit=False) as other:
        # Another transaction holds the row: the heartbeat below waits for it.
        other.execute("SELECT 1 FROM mos_lease.logical_agent_connector_leases WHERE "
                      "tenant_id = %s AND binding_id = 'in-flight' FOR UPDATE", (pg_tenant,))

        def call() -> None:
            try:
                answers.append(pg_store.apply(renew, entry_for(renew)))
            except Exception as error:  # what the call got is its answer
                answers.append(error)

        worker = threading.Thread(target=call)
        worker.start()
        time.sleep(0.3)  # the heartbeat is waiting on the row lock now
        closer = threading.Thread(target=pg_store.close)
        closer.start()
        time.sleep(0.3)
        assert closer.is_alive(), "the store closed under a statement in flight"
        other.commit()  # the heartbeat gets its row and ends
        worker.join(10)
        closer.join(10)
    assert not worker.is_alive() and not closer.is_alive()
    [answer] = answers
    assert isinstance(answer, WriteOutcome) and answer.row is not None, answer
