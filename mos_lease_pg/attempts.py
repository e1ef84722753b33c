"""One store call's attempts: what a failed statement means, and whether it goes out again.

A store call sends its statement once. That first attempt is all most calls ever need, so
the stores send it with nothing built around it: a connection entered, a deadline watch
armed, the statement sent, its rows parsed. Only when the attempt failed does a store build
what this module holds, the rules for a failure, written once as a sans-IO flow:

    sent = attempt(call)                       # the store's own I/O: rows, or a Missed
    if sent.__class__ is Missed:
        return drive(resending(call, ..., sent))   # the flow yields Resend, is sent rows

:func:`resending` decides from a :class:`Missed` which error to raise, or yields
:class:`Resend` once for the call to go out again on a fresh connection; the sync and the
asyncio store perform that step with the same attempt they started with and hand the
outcome back (``mos_lease.flowdrive``). A rule changed here changes both stores.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Final, TypeVar, final

import psycopg

from mos_lease.clock import MonotonicClock
from mos_lease.errors import CommitOutcomeUnknown, MosLeaseError, StoreUnavailable
from mos_lease_pg.reconcile import IN_DOUBT, UNAUDITED, Lost
from mos_lease_pg.rows import Row
from mos_lease_pg.statements import Call, Kind
from mos_lease_pg.translate import Failure, clock_stepped, connection_lost, statement_failure
from mos_lease_pg.wire import AnyWire, forgotten

T = TypeVar("T")

Covers = Callable[[], Sequence[Call[Any]]]


@final
class Missed:
    """An attempt whose statement failed: the driver error, the connection's sender (what
    reconciling needs to know of it) and whether the call's deadline watch cut it off. The
    attempt already closed a connection that cannot be used again."""

    __slots__ = ("exc", "timed_out", "wire")

    def __init__(self, exc: psycopg.Error, wire: AnyWire, timed_out: bool) -> None:
        self.exc = exc
        self.wire = wire
        self.timed_out = timed_out


@final
class Resend:
    """The step :func:`resending` yields: send ``call`` once more, within the same deadline,
    and hand back its rows or its :class:`Missed`."""

    __slots__ = ("call",)

    def __init__(self, call: Call[Any]) -> None:
        self.call = call


Sent = list[Row] | Missed


def needs_discard(exc: psycopg.Error, wire: AnyWire) -> bool:
    """Whether a connection whose statement raised ``exc`` must not be used again: it is
    lost, the server forgot a statement psycopg prepared on it (its prepared-statement
    cache is wrong from now on), or the reply was not read to its end (the next call would
    read it as its own). A dedicated connection is replaced on the next call; a pool
    replaces a closed connection it gets back."""
    conn = wire.conn
    return (connection_lost(exc) or forgotten(exc, wire)
            or (not conn.closed and conn.info.transaction_status is not _IDLE))


_IDLE: Final = psycopg.pq.TransactionStatus.IDLE


def resending(call: Call[T], covers: Covers | None, deadline: float, bound: float,
              clock: MonotonicClock, missed: Missed) -> Generator[Resend, Sent, T]:
    """What follows a failed first attempt: raise its error, or send the call once more."""
    judge = _Judge(call, covers, bound)
    # Never past the call's deadline, and only once.
    error = judge.error(missed, again=clock() < deadline)
    if error is not None:
        raise error from missed.exc
    try:
        sent = yield Resend(call)
        if sent.__class__ is Missed:
            assert isinstance(sent, Missed)
            error = judge.error(sent, again=False)
            assert error is not None
            raise error from sent.exc
    except StoreUnavailable as exc:
        # When the resend of an audit append fails too (no connection, no reply), the first
        # attempt may have committed, so the outcome is unknown, not "nothing changed".
        if isinstance(judge.lost, CommitOutcomeUnknown):
            raise judge.lost from exc
        raise
    assert isinstance(sent, list)
    return call.parse(sent)


class _Judge:
    """What a failure of ``call`` means (``covers``: the writes a combined statement stands
    for, each of them in doubt on its own if it is lost)."""

    __slots__ = ("_bound", "_call", "_covers", "lost")

    def __init__(self, call: Call[Any], covers: Covers | None, bound: float) -> None:
        self._call = call
        self._covers = covers
        self._bound = bound
        self.lost: MosLeaseError | None = None  # the resent call's first failure

    def calls(self) -> Sequence[Call[Any]]:
        return [self._call] if self._covers is None else self._covers()

    def error(self, missed: Missed, *, again: bool) -> MosLeaseError | None:
        """The error to raise for ``missed``, or ``None``: the call goes out once more."""
        # The server forgot a prepared statement: it ran nothing, so any call, a write too,
        # is sent once more (on a fresh connection: the attempt closed this one).
        if again and forgotten(missed.exc, missed.wire):
            return None
        # The database clock stepped inside the statement, between its stamp and the
        # schema's check of it: refused and rolled back, so it is sent once more, a write
        # too; that attempt reads the clock again (and a step back is refused clock_behind).
        if again and clock_stepped(missed.exc):
            return None
        failure = self._failure(missed)
        # Only a call that cannot change anything twice is sent again, and only when the
        # connection (not the statement) failed: typically the first use of a connection
        # that died while idle, e.g. across a database restart.
        if again and failure.connection_lost and self._call.kind is not Kind.WRITE:
            self.lost = failure.error
            return None
        return failure.error

    def _failure(self, missed: Missed) -> Failure:
        """Translate a failure of one call, or of a batch of writes sent together."""
        calls = self.calls()
        first = calls[0]
        what = first.what if len(calls) == 1 else f"batch of {len(calls)} writes"
        if missed.timed_out:
            what = f"{what} (no reply within the {self._bound:g} s call bound)"
        # An idempotent write (an audit append) lost with its connection may have committed
        # too: unless a resend settles it, its outcome is unknown, never "nothing changed".
        failure = statement_failure(
            missed.exc, what=what,
            write_event=first.event_id if first.kind is not Kind.READ else None)
        wire = missed.wire
        if failure.connection_lost and wire.backend_pid is not None:
            # The backend that ran these writes may still commit them: note it, so that
            # reconciling ends it first (reconcile.py). Where no pid names it (behind a
            # pooler), nothing is noted: reconcile waits out the role's transactions.
            IN_DOUBT.note([c.event_id for c in calls
                           if c.kind is not Kind.READ and c.event_id is not None],
                          Lost(wire.server, wire.backend_pid))
        if isinstance(failure.error, CommitOutcomeUnknown):
            UNAUDITED.note([c.event_id for c in calls
                            if not c.audited and c.event_id is not None])
        return failure
