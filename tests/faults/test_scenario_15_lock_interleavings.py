"""Scenario 15: lock interleavings -> a write that waited for a lock is judged after it.

For every write (heartbeat, release, takeover, batch heartbeat) and for validation, a
blocker session holds the lease row (``FOR SHARE`` or ``FOR UPDATE``) or the audit table
(``ACCESS EXCLUSIVE``) across the lease's expiry and across a rival gateway's takeover
attempt; meanwhile the rival observes the lease expired (its grant issue on the holder's
handle is refused ``lease_expired``, an unlocked read). Schedules are randomized (seeded):
the operation, the lock, when the operation is sent, when the blocker commits. Judged:

* the history checker over the audit log, including "no operation that committed after
  another session observed the lease expired renews (or releases) that lease";
* every write that waited past the expiry is refused (only the rival's takeover wins);
* every lease write that waited for the blocker is stamped no earlier than the blocker's
  commit (it read the clock once it held the lock). An observation's own audit row is no
  yardstick: it is appended after its unlocked read, and a write holding the lock may read
  the clock between the two (the documented residual of invariant 9);
* no validation is accepted at or after the expiry it was told.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    LeaseHandle,
    LeaseIdentity,
    Reason,
)
from mos_lease_pg import PostgresLeaseStore
from mos_lease_pg.sql_files import DEFAULT_SCHEMA
from tests.faults.history import AuditRow, Kind, check_history
from tests.faults.support import Table, audit_rows, db_now, run_prefix, scaled

pytestmark = [pytest.mark.faults, pytest.mark.pg]

TTL = 0.5  # seconds: short, so one schedule takes about a second
OPS = ("heartbeat", "release", "takeover", "heartbeat_many", "validate")
LOCKS = ("row_share", "row_update", "audit_table")
WAIT_S = 15.0  # bound on every join: a wedged schedule fails instead of hanging
SCOPES = ["tool:read"]
PAIRS = [(op, lock) for op in OPS for lock in LOCKS]

_LOCK_SQL = {
    "row_share": "FOR SHARE",
    "row_update": "FOR UPDATE",
}


class Call:
    """One library call in a thread of its own (it may wait for the blocker)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.answer: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.answer = fn()
        except BaseException as failure:  # re-raised by result(), in the test's thread
            self.error = failure

    def result(self) -> Any:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "a call never returned after the blocker ended"
        if self.error is not None:
            raise self.error
        return self.answer


def hold(conn: psycopg.Connection[Any], lock: str, idents: list[LeaseIdentity]) -> None:
    # The tables live in the library's schema, named explicitly (nothing uses search_path).
    schema = sql.Identifier(DEFAULT_SCHEMA)
    if lock == "audit_table":
        conn.execute(sql.SQL("LOCK TABLE {}.connector_lease_audit_log IN ACCESS EXCLUSIVE MODE"
                             ).format(schema))
        return
    for ident in idents:
        conn.execute(sql.SQL(
            "SELECT 1 FROM {}.logical_agent_connector_leases WHERE tenant_id = %s "
            "AND logical_agent_id = %s AND binding_id = %s {}").format(
                schema, sql.SQL(_LOCK_SQL[lock])),
            (ident.tenant_id, ident.logical_agent_id, ident.binding_id))


class Schedule:
    """One randomized interleaving; ``run`` returns what went wrong (empty: nothing)."""

    def __init__(self, rng: random.Random, n: int, prefix: str, dsn: str,
                 holder: ConnectorLeaseCoordinator, rival: ConnectorLeaseCoordinator,
                 admin: psycopg.Connection[Any]) -> None:
        # Every (operation, lock) pair in turn; the timing is what is randomized.
        self.op, self.lock = PAIRS[n % len(PAIRS)]
        self.send_at = rng.uniform(0.0, TTL * 0.8)  # sent before the expiry
        self.commit_after = rng.uniform(0.05, 0.3)  # past the expiry
        self.idents = [LeaseIdentity(prefix, f"s{n}", f"b{i}")
                       for i in range(2 if self.op == "heartbeat_many" else 1)]
        self._dsn, self._holder, self._rival, self._admin = dsn, holder, rival, admin
        self.released_before: datetime | None = None  # database time just before the commit

    def run(self) -> list[str]:
        problems: list[str] = []
        leases: list[LeaseHandle] = []
        for ident in self.idents:
            got = self._holder.acquire(ident, "holder", scopes=SCOPES, ttl=TTL)
            assert got.lease is not None, got
            leases.append(got.lease)
        began = time.monotonic()
        expires_at: datetime = leases[0].expires_at
        grant = None
        if self.op == "validate":
            issued = self._holder.issue_grant(leases[0], scopes=SCOPES, ttl=TTL)
            assert issued.grant is not None, issued
            grant = issued.grant
        with psycopg.connect(self._dsn) as blocker:
            hold(blocker, self.lock, self.idents)
            time.sleep(max(0.0, began + self.send_at - time.monotonic()))
            sent_at = db_now(self._admin)
            call = Call(self._operation(leases, grant))
            # Past the expiry: the rival observes it (an unlocked read, audited) and tries
            # to take over; both may wait for the blocker too.
            time.sleep(max(0.0, (expires_at - db_now(self._admin)).total_seconds()) + 0.02)
            observers = [Call(functools.partial(self._rival.issue_grant, lease,
                                                scopes=SCOPES, ttl=1)) for lease in leases]
            time.sleep(0.02)
            rivals = [Call(functools.partial(self._rival.takeover, ident, "rival",
                                             scopes=SCOPES, ttl=5, expected_epoch=1))
                      for ident in self.idents]
            time.sleep(self.commit_after)
            self.released_before = db_now(self._admin)
            blocker.commit()
        answer = call.result()
        for observer in observers:
            observer.result()
        answers = answer if isinstance(answer, list) else [answer]
        for rival in rivals:
            taken = rival.result()
            # Exactly one takeover wins: the rival's, or the third connector's when that
            # was the operation under test (both compete for epoch 2).
            winners = int(taken.ok) + sum(int(a.ok) for a in answers
                                          if self.op == "takeover")
            if winners != 1:
                problems.append(f"{winners} takeovers won (rival: {taken.reason})")
        for result in answers:
            if self.op == "validate":
                if result.context is not None and sent_at >= expires_at:
                    problems.append("validation accepted at or after the expiry")
            elif self.op != "takeover" and result.ok:
                problems.append(f"{self.op} committed after the lease was seen expired")
        return problems

    def _operation(self, leases: list[LeaseHandle], grant: Any) -> Callable[[], Any]:
        holder, lease = self._holder, leases[0]
        if self.op == "heartbeat":
            return lambda: holder.heartbeat(lease, ttl=60)
        if self.op == "release":
            return lambda: holder.release(lease)
        if self.op == "heartbeat_many":
            return lambda: holder.heartbeat_many(leases, ttl=60)
        if self.op == "validate":
            return lambda: holder.validate(grant, identity=lease.identity, scopes=SCOPES)
        # A preempting takeover by a third connector, sent while the lease is active.
        return lambda: holder.takeover(lease.identity, "third", scopes=SCOPES, ttl=60,
                                       expected_epoch=1)


def stamped_before_release(rows: list[AuditRow], schedules: list[Schedule]) -> list[str]:
    """Lease writes of a schedule stamped before its blocker committed: every one of them
    (the operation under test, the rival's takeover) was sent while the blocker held the
    lock, so a stamp before the release is a clock read before the lock wait."""
    released = {(ident.tenant_id, ident.logical_agent_id, ident.binding_id): s.released_before
                for s in schedules for ident in s.idents}
    found = []
    for row in rows:
        before = released.get(row.identity)
        if row.outcome in ("renewed", "released", "taken_over") and before is not None \
                and row.recorded_at < before:
            found.append(f"seq {row.seq} {row.outcome} stamped {row.recorded_at} before the "
                         f"blocker's commit at {before}")
    return found


def test_lock_interleavings(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                            figures: Table) -> None:
    schedules = scaled(soak, 20, 300)
    prefix = run_prefix("s15")
    rng = random.Random(15)
    holder_store, rival_store = PostgresLeaseStore(pg_dsn), PostgresLeaseStore(pg_dsn)
    problems: list[str] = []
    kinds: Counter[str] = Counter()
    done: list[Schedule] = []
    try:
        holder = ConnectorLeaseCoordinator(holder_store, AllowAllPolicy())
        rival = ConnectorLeaseCoordinator(rival_store, AllowAllPolicy())
        for n in range(schedules):
            schedule = Schedule(rng, n, prefix, pg_dsn, holder, rival, admin)
            kinds[f"{schedule.op}/{schedule.lock}"] += 1
            problems += [f"#{n} {schedule.op}/{schedule.lock}: {p}" for p in schedule.run()]
            done.append(schedule)
    finally:
        holder_store.close()
        rival_store.close()
    audit = audit_rows(admin, prefix)
    violations = check_history([], audit, audited=False)
    seen_expired = [v for v in violations if v.kind is Kind.RENEWED_AFTER_SEEN_EXPIRED]
    early = stamped_before_release(audit, done)
    observed = sum(1 for r in audit if r.reason == Reason.LEASE_EXPIRED.value)

    figures.counts("randomized schedules", schedules, schedules)
    figures.add("operation/lock pairs covered", len(kinds), str(len(PAIRS)),
                len(kinds) == len(PAIRS))
    figures.add("expiries observed by the rival (lease_expired rows)", observed,
                ">= schedules", observed >= schedules)
    figures.add("writes committed after the lease was seen expired", len(seen_expired), "0",
                not seen_expired)
    figures.add("writes that waited stamped before the blocker's commit", len(early), "0",
                not early)
    figures.add("schedule failures (renewal/release won, rival refused, late validation)",
                len(problems), "0", not problems)
    figures.add("history checker violations", len(violations), "0", not violations)
    for text in [str(v) for v in violations[:5]] + early[:5] + problems[:10]:
        figures.notes.append(text)
    assert not figures.failed(), figures.render()
