"""Time is read after the lock: a write that waited for the lease row is judged by a clock
read once it holds the row, never by one read before the wait.

The expired-lease renewal, reproduced on the real clock: a lease with a 2 s TTL; a second session
holds the row (``FOR SHARE``, as a fenced effect transaction does); the holder's write is sent
at ~0.6 s and blocks; after the expiry another gateway observes the lease expired (its
acquire is refused ``takeover_required``); then the blocker commits. Judged by the time it
read before the wait, the write would renew (or release) a lease that other gateway had
already seen expire, its takeover would then be refused, and the audit log's ``recorded_at``
would run backwards against ``seq``. Judged after the lock, the write is refused
``lease_expired`` and the other gateway's takeover succeeds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any
from uuid import uuid4

import attrs
import psycopg
import pytest
from psycopg import sql

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    LeaseHandle,
    LeaseIdentity,
    LeaseResult,
    Outcome,
    Reason,
)
from mos_lease.ids import uuid7
from mos_lease.machine import Close, Insert, Renew, Rotate
from mos_lease.records import AuditEntry
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_pg import PostgresLeaseStore, sql_files, statements
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ["tool:read"]
TTL_S = 2.0
SEND_AT_S = 0.6  # when the blocked write is sent, well inside the TTL
WAIT_S = 10.0  # bound on every poll and join: a hang fails the test instead of wedging it

# The tables live in the library's schema, named explicitly (nothing uses search_path).
LOCK_ROW = sql.SQL("SELECT 1 FROM {}.logical_agent_connector_leases WHERE tenant_id = %s "
                   "AND logical_agent_id = %s AND binding_id = %s FOR SHARE").format(
                       sql.Identifier(sql_files.DEFAULT_SCHEMA))
WAITING = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
           "AND wait_event_type = 'Lock'")


@contextmanager
def row_held(dsn: str, *identities: LeaseIdentity) -> Iterator[None]:
    """A second session holding the lease rows ``FOR SHARE`` until the block exits, then
    committing (a fenced effect transaction does exactly this)."""
    with psycopg.connect(dsn) as conn:
        for ident in identities:
            conn.execute(LOCK_ROW, (ident.tenant_id, ident.logical_agent_id, ident.binding_id))
        yield
        conn.commit()


def wait_until(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


class Blocked:
    """Runs one call in a thread (it blocks on the row lock) and keeps its answer."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._call = call
        self.answer: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.answer = self._call()
        except BaseException as failure:  # reported by join(), in the test's thread
            self.error = failure

    @property
    def waiting(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> Any:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the blocked write never returned"
        if self.error is not None:
            raise self.error
        return self.answer


def observe_expired(gateway: ConnectorLeaseCoordinator, ident: LeaseIdentity) -> None:
    """Another gateway observes the lease expired: its acquire says ``takeover_required``
    (``lease_held`` while the lease is still active). The refusal is audited, so the audit
    log holds the time at which it was observed."""
    def expired() -> bool:
        result = gateway.acquire(ident, "rival", scopes=SCOPES, ttl=10)
        assert result.reason in (Reason.LEASE_HELD, Reason.TAKEOVER_REQUIRED), result
        return result.reason is Reason.TAKEOVER_REQUIRED
    wait_until("the rival gateway sees the lease expired", expired)


def assert_audit_in_time_order(store: PostgresLeaseStore, ident: LeaseIdentity) -> None:
    records = sorted(store.audit(ident), key=lambda record: record.seq)
    times = [record.recorded_at for record in records]
    assert times == sorted(times), [(r.seq, r.entry.event.value, r.entry.outcome.value,
                                     r.recorded_at.isoformat()) for r in records]


@pytest.fixture
def gateways(pg_stores: StoreFactory) -> tuple[ConnectorLeaseCoordinator,
                                               ConnectorLeaseCoordinator, PostgresLeaseStore]:
    """Gateway A (the holder's) and gateway B (the rival's), each on a store of its own."""
    store_a, store_b = pg_stores(), pg_stores()
    return (ConnectorLeaseCoordinator(store_a, AllowAllPolicy()),
            ConnectorLeaseCoordinator(store_b, AllowAllPolicy()), store_b)


def acquire(gateway: ConnectorLeaseCoordinator, ident: LeaseIdentity) -> tuple[LeaseHandle,
                                                                                float]:
    started = time.monotonic()
    result = gateway.acquire(ident, "holder", scopes=SCOPES, ttl=TTL_S)
    assert result.lease is not None, result
    return result.lease, started


def blocked_past_expiry(pg_dsn: str, pg_admin: psycopg.Connection[Any],
                        rival: ConnectorLeaseCoordinator, idents: list[LeaseIdentity],
                        started: float, call: Callable[[], Any]) -> Any:
    """Hold the rows, send ``call`` at ~0.6 s, let the lease expire and the rival observe
    it, then commit the blocker and return what ``call`` answered."""
    with row_held(pg_dsn, *idents):
        time.sleep(max(0.0, started + SEND_AT_S - time.monotonic()))
        blocked = Blocked(call)
        wait_until("the write waits for the row lock",
                   lambda: pg_admin.execute(WAITING).fetchone() == (1,))
        for ident in idents:
            observe_expired(rival, ident)
        assert blocked.waiting  # still waiting for the lock: the blocker has not committed
    return blocked.join()


def assert_refused_expired(result: LeaseResult) -> None:
    assert result.outcome is Outcome.DENIED, result
    assert result.reason is Reason.LEASE_EXPIRED, result


def take_over(rival: ConnectorLeaseCoordinator, ident: LeaseIdentity) -> None:
    result = rival.takeover(ident, "rival", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert result.ok, result
    assert result.current_epoch == 2


@pytest.mark.parametrize("operation", ["heartbeat", "release"])
def test_holder_write_that_waited_past_expiry_is_refused(
        operation: str, gateways: tuple[ConnectorLeaseCoordinator, ConnectorLeaseCoordinator,
                                        PostgresLeaseStore],
        pg_dsn: str, pg_admin: psycopg.Connection[Any], pg_tenant: str) -> None:
    holder, rival, rival_store = gateways
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    lease, started = acquire(holder, ident)

    def write() -> LeaseResult:
        if operation == "heartbeat":
            return holder.heartbeat(lease, ttl=60)
        return holder.release(lease)

    assert_refused_expired(blocked_past_expiry(pg_dsn, pg_admin, rival, [ident], started,
                                               write))
    take_over(rival, ident)
    assert_audit_in_time_order(rival_store, ident)


def test_batch_renewal_skips_a_held_row_and_renews_it_only_while_live(
        gateways: tuple[ConnectorLeaseCoordinator, ConnectorLeaseCoordinator,
                        PostgresLeaseStore],
        pg_dsn: str, pg_tenant: str) -> None:
    """A batch does not wait for a held row (renew_many.sql, SKIP LOCKED): the held lease is
    not reached (``store_unavailable``, nothing written) while the other renews at once.
    The held lease then expires and the rival sees it expired; after the holder commits, a
    renewal of it is judged by the time read once the row is locked: refused
    ``lease_expired``, and the rival's takeover succeeds."""
    holder, rival, rival_store = gateways
    idents = [LeaseIdentity(pg_tenant, "agent", f"b{i}") for i in (1, 2)]
    leases = [acquire(holder, ident)[0] for ident in idents]
    with row_held(pg_dsn, idents[0]):
        began = time.monotonic()
        results = holder.heartbeat_many(leases, ttl=60)
        assert time.monotonic() - began < TTL_S / 2  # no lock wait
        assert results[0].reason is Reason.STORE_UNAVAILABLE, results
        assert results[1].ok, results
        observe_expired(rival, idents[0])
    (late,) = holder.heartbeat_many(leases[:1], ttl=60)
    assert_refused_expired(late)
    take_over(rival, idents[0])
    assert_audit_in_time_order(rival_store, idents[0])


def test_takeover_that_waited_is_stamped_after_what_others_observed(
        gateways: tuple[ConnectorLeaseCoordinator, ConnectorLeaseCoordinator,
                        PostgresLeaseStore],
        pg_stores: StoreFactory, pg_dsn: str, pg_admin: psycopg.Connection[Any],
        pg_tenant: str) -> None:
    """A takeover sent while the lease was active (preempting) waits for the row; a third
    gateway observes the lease expired meanwhile. The takeover commits, but its lease and
    audit row are stamped no earlier than that observation, never with the pre-wait time."""
    holder, rival, rival_store = gateways
    third = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    _, started = acquire(holder, ident)
    result = blocked_past_expiry(pg_dsn, pg_admin, third, [ident], started,
                                 lambda: rival.takeover(ident, "rival", scopes=SCOPES,
                                                        ttl=10, expected_epoch=1))
    assert result.ok, result
    assert result.lease is not None and result.current_epoch == 2
    observed: datetime = max(record.recorded_at for record in rival_store.audit(ident)
                             if record.entry.reason is Reason.TAKEOVER_REQUIRED)
    row = rival_store.load(ident).row
    assert row is not None and row.epoch == 2
    assert row.acquired_at >= observed, (row.acquired_at, observed)
    assert_audit_in_time_order(rival_store, ident)


def _plan_calls() -> dict[str, statements.Call[Any]]:
    """One call of every write statement, with parameters of the right types."""
    ident = LeaseIdentity("plan", "agent", "b1")
    ttl, offset = timedelta(seconds=2), timedelta(0)

    def entry(event: LifecycleEvent) -> AuditEntry:
        return AuditEntry(uuid7(), event, Outcome.RENEWED, None, ident, "c", 1, "corr")

    renew = Renew(ident, "c", uuid4(), 1, ttl)
    batch = statements.renew_many(
        [(renew, entry(LifecycleEvent.HEARTBEAT)),
         (attrs.evolve(renew, identity=LeaseIdentity("plan", "agent", "b2")),
          attrs.evolve(entry(LifecycleEvent.HEARTBEAT),
                       identity=LeaseIdentity("plan", "agent", "b2")))], offset)
    assert batch is not None
    return {
        "insert": statements.apply(Insert(ident, uuid4(), "c", ("s",), ttl),
                                   entry(LifecycleEvent.ACQUIRE), offset),
        "renew": statements.apply(renew, entry(LifecycleEvent.HEARTBEAT), offset),
        "close": statements.apply(Close(ident, "c", uuid4(), 1),
                                  entry(LifecycleEvent.RELEASE), offset),
        "rotate": statements.apply(Rotate(ident, 1, False, uuid4(), "c", ("s",), ttl),
                                   entry(LifecycleEvent.TAKEOVER), offset),
        "renew_many": batch,
    }


@pytest.mark.parametrize("name", ["insert", "renew", "close", "rotate", "renew_many"])
def test_plan_locks_the_row_before_it_reads_the_clock(
        name: str, pg_admin: psycopg.Connection[Any]) -> None:
    """The order holds in the plan, not only by luck of timing: the clock CTE is its own
    materialized step whose input is the locking CTE (a LockRows node), so the executor
    cannot read the clock before the lock is held. An insert locks nothing (it writes only
    where no row exists, and an acquire of a held identity must not wait behind a lock)."""
    call = _plan_calls()[name]
    rows = pg_admin.execute(b"EXPLAIN (COSTS OFF) " + call.statement.text,
                            dict(call.params)).fetchall()
    plan = "\n".join(row[0] for row in rows)
    locked, clock = plan.index("CTE locked"), plan.index("CTE t")
    assert locked < clock, plan
    assert ("LockRows" in _subplan(plan, "CTE locked")) is (name != "insert"), plan
    # The clock step reads from `locked`, and nothing else feeds it.
    assert "CTE Scan on locked" in _subplan(plan, "CTE t"), plan


def _subplan(plan: str, head: str) -> str:
    """The lines of ``plan`` from the node ``head`` up to its next sibling."""
    lines = plan.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == head)
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next((i for i in range(start + 1, len(lines))
                if len(lines[i]) - len(lines[i].lstrip()) <= indent), len(lines))
    return "\n".join(lines[start:end])
