"""Truthful reconciliation of a write whose connection was lost.

A write and its audit row commit together, so whether the audit event exists with an
outcome other than ``denied`` says whether the write took effect (a refusal's row reuses the
event id of the write it refused: ``event_committed.sql``): but only once the write can no
longer commit. A write lost while it
waited (for its row, behind a lock on the audit table, or before it reached its row) may
still commit after the event was looked for. So before looking, the store makes sure the
lost session is over:

* **Remembered writes** (lost by a store of this process, whichever instance): the store
  noted the backend pid of the connection (``conn.info.backend_pid``) when the connection
  was lost. From another connection it terminates that backend (``pg_terminate_backend``,
  allowed on the role's own backends) and polls until the backend is gone, within the call
  bound. A backend aborts its transaction before it leaves ``pg_stat_activity``, so from then
  on the answer cannot change. If the bound passes first, the outcome stays unknown
  (``StoreUnavailable``), never guessed.
* **Behind a transaction pooler** (the store built with the pooler settings, or a startup pid
  that names no backend) nothing is remembered: the pid of the connection's startup is the
  pooler's own, and the backend that ran the write may serve another client by now. Such a
  write is reconciled as an event this process does not remember (below).
* **Events this process does not remember** (another process, or more than
  ``IN_DOUBT_MEMORY`` writes ago): no backend is known, so reconcile waits, within the call
  bound, until every other backend of the role in this database that was inside a
  transaction when reconcile began has finished it. Every write is one statement in one
  transaction, so a write that had reached the server by then is settled. The bound of this
  path: a write whose bytes had not yet reached the server when reconcile began (still in
  a network buffer of a process that lost its connection) is not covered; call it after the
  writer's connection is closed (its process gone, or its own store's call bound passed).

Whatever reconcile answers, the database applies an event id at most once (migration 0004):
a write sent again under an event id that committed meanwhile is refused and reported as
``CommitOutcomeUnknown``, never applied twice.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import datetime
from typing import Any, Final
from uuid import UUID

import attrs

from mos_lease.errors import CommitOutcomeUnknown, InternalInconsistency, StoreUnavailable
from mos_lease.records import AuditEntry
from mos_lease_pg import statements
from mos_lease_pg.rows import Row
from mos_lease_pg.statements import Call

IN_DOUBT_MEMORY: Final = 1024
POLL: Final = 0.02  # seconds between looks at pg_stat_activity

# Loaded exactly as statements.py loads its own (comments dropped, schema checked).
BACKEND_ALIVE: Final = statements._statement("backend_alive.sql")
RUNNING_BEFORE: Final = statements._statement("running_before.sql")
RECORD_MATCHES: Final = statements._statement("record_matches.sql")


@attrs.frozen(slots=True)
class Lost:
    """Where a write in doubt was running: its server (host, port, database) and backend."""

    server: tuple[str, str, str]
    pid: int


class InDoubt:
    """Writes whose connection was lost, by audit event: one memory for every store of the
    process, so that a new store instance still knows which backend to end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lost: OrderedDict[UUID, Lost] = OrderedDict()

    def note(self, event_ids: list[UUID], lost: Lost) -> None:
        with self._lock:
            for event_id in event_ids:
                self._lost[event_id] = lost
            while len(self._lost) > IN_DOUBT_MEMORY:
                self._lost.popitem(last=False)

    def get(self, event_id: UUID) -> Lost | None:
        with self._lock:
            return self._lost.get(event_id)

    def forget(self, event_id: UUID) -> None:
        with self._lock:
            self._lost.pop(event_id, None)

    def clear(self) -> None:
        """Forget everything (tests: what a new process knows)."""
        with self._lock:
            self._lost.clear()


IN_DOUBT: Final = InDoubt()


class Unaudited:
    """Event ids of heartbeats sent without an audit row (``audit_heartbeats=False``) whose
    connection was lost: the log cannot say whether they committed, so reconcile must not
    answer from it. One bounded memory for every store of the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: OrderedDict[UUID, None] = OrderedDict()

    def note(self, event_ids: list[UUID]) -> None:
        with self._lock:
            for event_id in event_ids:
                self._ids[event_id] = None
            while len(self._ids) > IN_DOUBT_MEMORY:
                self._ids.popitem(last=False)

    def __contains__(self, event_id: object) -> bool:
        # Kept after a look: asked again, the answer is still "cannot be told".
        with self._lock:
            return event_id in self._ids


UNAUDITED: Final = Unaudited()


def unaudited_outcome(event_id: UUID) -> CommitOutcomeUnknown:
    return CommitOutcomeUnknown(
        event_id, "a heartbeat sent without its audit row (audit_heartbeats=False) lost its "
        "reply: whether it renewed the lease cannot be looked up; heartbeat again")


def _single(rows: list[Row] | Any) -> Row:
    if len(rows) != 1:
        raise AssertionError(f"expected exactly one row, got {len(rows)}")
    return tuple(rows[0])


def _count(rows: Any) -> int:
    return int(_single(rows)[0])


def _flag(rows: Any) -> bool:
    return bool(_single(rows)[0])


def _since_and_count(rows: Any) -> tuple[datetime, int]:
    since, count = _single(rows)
    return since, int(count)


def terminate(pid: int, *, schema: str) -> Call[int]:
    return Call("end of the lost backend", statements.END_LOST_BACKEND.at(schema), {"pid": pid},
                _count)


def backend_alive(pid: int, *, schema: str) -> Call[bool]:
    return Call("lost backend lookup", BACKEND_ALIVE.at(schema), {"pid": pid}, _flag)


def running_before(since: datetime | None, *, schema: str) -> Call[tuple[datetime, int]]:
    return Call("in-flight transaction lookup", RUNNING_BEFORE.at(schema), {"since": since},
                _since_and_count)


def record(entry: AuditEntry, offset: Any, *, schema: str) -> Call[int]:
    """``statements.record``, reading how many rows it inserted."""
    plain = statements.record(entry, offset, schema=schema)
    return Call(plain.what, plain.statement, plain.params, _count, plain.kind,
                plain.event_id, plain.identity)


def record_matches(call: Call[int], *, schema: str) -> Call[bool]:
    params = {k: v for k, v in call.params.items() if k != "offset"}
    return Call("audit record check", RECORD_MATCHES.at(schema), params, _flag)


def conflicting_record(entry: AuditEntry) -> InternalInconsistency:
    return InternalInconsistency(
        f"audit event {entry.event_id} is already recorded for another attempt: the "
        f"{entry.event} {entry.outcome} record would have been lost")


def unmatched_record(entry: AuditEntry, down: StoreUnavailable) -> CommitOutcomeUnknown:
    """A record found its event id taken (typically by its own first attempt, whose reply
    was lost) but the check that the row is this record failed: the row exists, so the
    outcome is unknown, never "nothing changed"."""
    return CommitOutcomeUnknown(entry.event_id, f"audit record {entry.event_id} is in the "
                                f"log, but could not be checked to be this one: {down}")


def still_running(what: str, bound: float) -> StoreUnavailable:
    return StoreUnavailable(
        f"{what} did not end within the {bound:g} s call bound: the write's outcome stays "
        "unknown")
