"""Coalesced calls: reads, and audit appends, that overlap in time on one store share one
round trip.

A gateway validates for many bindings at once, each validation rereading its lease, and
issues grants, each an audit row: one at a time, N calls cost N round trips (and N commits)
in turn on the store's connection; coalesced (group commit), one per batch.

    a call arrives   nothing in flight on the store's queue: it goes out at once, alone, as
                     the ordinary statement (``load.sql``, ``record.sql``; no wait, no
                     queue, no allocation). A call in flight: the new one queues. On
                     the asyncio store a call also queues while its other queue is busy
                     or its one connection taken (it would wait for it anyway).
    a call returns   whatever queued meanwhile goes out together as one statement
                     (``load_many.sql``: the keys unnested, joined to the lease table, each
                     row with its key's position and the database time;
                     ``record_many.sql``: each entry appended as ``record.sql`` appends it,
                     in one transaction), sent by the pump (a thread of the sync store, a
                     task of the asyncio store's loop, which first waits for the
                     connection and lets the callers woken with it queue: the tasks one
                     batch answered go out together again, so N grants in step cost one
                     load and one append per round, not two of each).

What each caller is told does not change:

* **After its call began.** A call queues only after its caller called, and a batch takes
  only calls queued before it is sent, so every read is sent after its caller's call began:
  a takeover committed before the call is seen, as a lone read would see it.
* **The same columns, the same time rule** as ``load.sql``: each key's row (or none) and the
  database clock read in the same statement. The flows judge each answer on its own (the
  in-flight rule counts time spent queued, as the caller measures it); a batched load's
  snapshot says how long it queued (``Snapshot.queued``, read by the slow-reply warning).
* **Each append is its own**: its own row, its own event id checked as ``record`` checks it
  (a resend of the same record logs once; an id taken by another record is that caller's
  error alone).
* **Each caller's own bound.** A caller waits for its answer only until its own deadline
  (the call bound, ``mos_lease.operation``: a validation's counts from its start); then it
  fails closed with ``StoreUnavailable``, and its key is dropped from the queue if it has
  not gone out (an append that went out and was not answered in time is
  ``CommitOutcomeUnknown``: it may have committed). The batch statement is bounded by the
  latest deadline of the calls it carries (the pump is no caller), so it never cuts a caller
  shorter than its own bound.
* **Failures.** A failure of the shared statement is each caller's failure (a copy of its
  own; an append's unknown outcome names its own event id), except appends the database
  refused as a whole (nothing written): they go again one by one, and only the refused fails.
* **Cancellation** (asyncio) of a queued caller withdraws its call and is raised on, never
  swallowed; the shared round trip is the pump's, which no caller's cancellation cancels.
  A lone call is its caller's own, cancelled with it; what queued behind it goes out.

The rules (when a call goes alone, what a batch takes, who is told what) are :class:`Reads`,
written once; :class:`ThreadReads` and :class:`TaskReads` add how a caller waits and where
the pump runs, given what a lone call and a batch send: a store has one queue for every
load (a validation's, a grant issue's, a takeover's read) and one for every audit append.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Generic, Protocol, TypeVar

from mos_lease.clock import MonotonicClock
from mos_lease.errors import StoreUnavailable

T = TypeVar("T")

MAX_BATCH: Final = 1000  # the most keys one statement carries; more wait for the next one
PUMP_IDLE: Final = 5.0  # seconds the sync store's pump thread waits for a batch, then ends


class Ticket:
    """One queued call: its key (an identity to read, an entry to append), its caller's
    deadline and when it queued (store's clock); then its answer or the error to raise."""

    __slots__ = ("answer", "deadline", "error", "key", "since")

    def __init__(self, key: Any, deadline: float, since: float = 0.0) -> None:
        self.key = key
        self.deadline = deadline
        self.since = since
        self.answer: Any = None
        self.error: BaseException | None = None


K = TypeVar("K", bound=Ticket)


class Reads(Generic[K]):
    """The rules of coalescing, without I/O or locks: the sync store calls them under its
    lock, the asyncio store on its loop.

    ``busy`` is true while a call (a lone one or a batch) is in flight or queued calls wait
    for the pump to send them: at most one call of a queue is in flight at a time."""

    __slots__ = ("batches", "busy", "items", "waiting")

    def __init__(self) -> None:
        self.waiting: list[K] = []
        self.busy, self.batches, self.items = False, 0, 0  # batches sent: mos_lease.stats

    def alone(self) -> bool:
        """Whether a call arriving now goes out at once, alone (nothing is in flight)."""
        if self.busy:
            return False
        self.busy = True
        return True

    def returned(self) -> bool:
        """A lone call returned (or failed): True if calls queued meanwhile, which the pump
        must now send (the queue stays busy); False if none did (the queue is idle)."""
        if self.waiting:
            return True
        self.busy = False
        return False

    def take(self) -> list[K] | None:
        """The pump's next batch: the calls queued so far (at most :data:`MAX_BATCH`), or
        ``None`` when none are left (the queue is idle)."""
        waiting = self.waiting
        if not waiting:
            self.busy = False
            return None
        self.batches, self.items = self.batches + 1, self.items + min(len(waiting), MAX_BATCH)
        if len(waiting) <= MAX_BATCH:
            self.waiting = []
            return waiting
        batch = waiting[:MAX_BATCH]
        del waiting[:MAX_BATCH]
        return batch

    def withdraw(self, ticket: K) -> bool:
        """A caller gave up (its deadline, a cancellation): its call, if not sent yet, is
        left out of the next batch. Whether it was still queued (False: it went out)."""
        try:
            self.waiting.remove(ticket)
        except ValueError:  # sent already, and its answer is dropped when it comes
            return False
        return True

    def abandon(self, error: BaseException) -> list[K]:
        """The pump ended abnormally: every queued call fails with ``error`` (returned, for
        the shell to wake their callers) and the queue is idle."""
        left, self.waiting = self.waiting, []
        for ticket in left:
            ticket.error = error
        self.busy = False
        return left


def settle(batch: Sequence[Ticket], answers: Sequence[object]) -> None:
    """Hand each call of ``batch`` its answer; an exception among ``answers`` is that one
    call's error alone (an append whose event id another record holds)."""
    for ticket, answer in zip(batch, answers, strict=True):
        if isinstance(answer, BaseException):
            ticket.error = answer
        else:
            ticket.answer = answer


def keys(batch: Sequence[Ticket]) -> list[Any]:
    return [t.key for t in batch]  # in order


def own_copy(error: BaseException) -> BaseException:
    """A copy of ``error`` for one caller: one exception object raised in several threads
    or tasks at once would collect all their tracebacks."""
    try:
        mine = copy.copy(error)
    except Exception:  # an exception that cannot be rebuilt from its args: the shared one
        return error
    return mine if type(mine) is type(error) and str(mine) == str(error) else error


def outcome(ticket: Ticket) -> Any:
    """The answer of a settled call, or its error raised (a copy, caused by the shared one)."""
    error = ticket.error
    if error is not None:
        mine = own_copy(error)
        if mine is error:
            raise error
        raise mine from error
    return ticket.answer


def overdue(what: str, bound: float) -> StoreUnavailable:
    """The error of a caller whose bound passed while its call waited in the queue."""
    return StoreUnavailable(
        f"{what}: no reply within the {bound:g} s call bound (queued behind the store's "
        "call in flight)")


Late = Callable[[Any, float, bool], BaseException]
"""The error of a caller that gave up waiting: given its key, the call bound and whether
its call had gone out (a write that went out may have committed)."""


def late_read(_key: Any, bound: float, _sent: bool) -> BaseException:
    return overdue("load", bound)  # a read changes nothing, whether or not it went out


class _Store(Protocol):
    """What the shells use of a PostgreSQL store (``mos_lease_pg.store``)."""

    _clock: MonotonicClock
    _bound: float

    def _deadline(self, deadline: float | None) -> float: ...


class _ThreadTicket(Ticket):
    __slots__ = ("ready",)

    def __init__(self, key: Any, deadline: float, since: float) -> None:
        super().__init__(key, deadline, since)
        # Held until the answer is in; a plain lock is the cheapest thing a thread can wait
        # on with a timeout.
        self.ready = threading.Lock()
        self.ready.acquire()


class ThreadReads:
    """The sync store's coalesced calls: callers are threads, the pump a daemon thread of
    the store's own that ends after :data:`PUMP_IDLE` seconds without work. ``one`` sends a
    lone call (its key, its deadline), ``many`` a batch (its tickets, the batch's deadline:
    one answer, or one caller's own exception, per ticket), ``late`` names the error of a
    caller whose bound passed."""

    __slots__ = ("_late", "_lock", "_many", "_name", "_one", "_pump", "_reads", "_store",
                 "_wake")

    def __init__(self, store: _Store, one: Callable[[Any, float], Any],
                 many: Callable[[list[Ticket], float], Sequence[object]], *,
                 late: Late = late_read, name: str = "mos-lease-reads") -> None:
        self._store = store
        self._one = one
        self._many = many
        self._late = late
        self._name = name
        self._reads: Reads[_ThreadTicket] = Reads()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pump: threading.Thread | None = None

    def call(self, key: Any) -> Any:
        """The answer of ``key``'s call, sent after this call began."""
        store = self._store
        deadline = store._deadline(None)
        reads = self._reads
        with self._lock:
            ticket = (None if reads.alone()
                      else _ThreadTicket(key, deadline, store._clock()))
            if ticket is not None:
                reads.waiting.append(ticket)
        if ticket is None:
            try:
                return self._one(key, deadline)
            finally:
                with self._lock:
                    if reads.returned():
                        self._start_pump()
        if not ticket.ready.acquire(timeout=max(0.0, deadline - store._clock())):
            with self._lock:
                queued = reads.withdraw(ticket)
            raise self._late(key, store._bound, not queued)
        return outcome(ticket)

    def _start_pump(self) -> None:
        # Called under the lock, with calls queued and the queue busy: the pump sends them.
        if self._pump is not None:
            self._wake.notify()
            return
        self._pump = threading.Thread(target=self._pumping, name=self._name, daemon=True)
        self._pump.start()

    def _pumping(self) -> None:
        try:
            while True:
                with self._lock:
                    batch = self._reads.take()
                    while batch is None:
                        woken = self._wake.wait(PUMP_IDLE)
                        batch = self._reads.take()
                        if batch is None and not woken:
                            self._pump = None
                            return
                self._send(batch)
                # Let the callers just answered run (see TaskReads._pumping).
                time.sleep(0)
        except BaseException as error:
            with self._lock:
                self._pump = None
                left = self._reads.abandon(error)
            for ticket in left:
                ticket.ready.release()
            raise

    def _send(self, batch: list[_ThreadTicket]) -> None:
        try:
            settle(batch, self._many(list(batch), max(t.deadline for t in batch)))
        except BaseException as error:
            for ticket in batch:
                ticket.error = error
            if not isinstance(error, Exception):
                raise
        finally:
            for ticket in batch:
                ticket.ready.release()


class _TaskTicket(Ticket):
    __slots__ = ("future",)

    def __init__(self, key: Any, deadline: float, since: float,
                 future: asyncio.Future[None]) -> None:
        super().__init__(key, deadline, since)
        self.future = future


class TaskReads:
    """The asyncio store's coalesced calls: callers are tasks, the pump a task of the loop
    started when calls queued behind a lone one, ending when none are left. ``one``,
    ``many`` and ``late`` as for :class:`ThreadReads`, awaited.

    ``crowded`` says whether the store is another call's now (a call of its other queue in
    flight or queued, its one connection taken): a call arriving then queues instead of
    going alone, and ``free`` (awaited by the pump before it takes a batch) returns once
    the connection is free and the callers woken with it have run. So the tasks a batch's
    answer wakes together, each moving on to its next call (a grant's load, then its
    append), go out together again, not as one alone and the rest behind it."""

    __slots__ = ("_crowded", "_free", "_late", "_many", "_one", "_pump", "_reads", "_store")

    def __init__(self, store: _Store, one: Callable[[Any, float], Awaitable[Any]],
                 many: Callable[[list[Ticket], float], Awaitable[Sequence[object]]], *,
                 late: Late = late_read,
                 crowded: Callable[[], bool] | None = None,
                 free: Callable[[], Awaitable[None]] | None = None) -> None:
        self._store = store
        self._one = one
        self._many = many
        self._late = late
        self._crowded = crowded
        self._free = free
        self._reads: Reads[_TaskTicket] = Reads()
        self._pump: asyncio.Task[None] | None = None  # kept: the loop holds tasks weakly

    @property
    def busy(self) -> bool:
        """Whether a call of this queue is in flight or queued."""
        return self._reads.busy

    async def call(self, key: Any) -> Any:
        """As :meth:`ThreadReads.call`."""
        store = self._store
        deadline = store._deadline(None)
        reads = self._reads
        # (Asked before this call makes its own queue busy.)
        crowded = self._crowded is not None and self._crowded()
        if reads.alone():
            if not crowded:
                try:
                    return await self._one(key, deadline)
                finally:
                    # Also when this caller is cancelled: the calls behind it go out
                    # regardless.
                    if reads.returned():
                        self._pump = asyncio.get_running_loop().create_task(self._pumping())
            # The store is another call's: this one would wait for the connection anyway, so
            # it queues, and goes out with what queues meanwhile once the connection is free.
            self._pump = asyncio.get_running_loop().create_task(self._pumping())
        ticket = _TaskTicket(key, deadline, store._clock(),
                             asyncio.get_running_loop().create_future())
        reads.waiting.append(ticket)
        try:
            # asyncio.timeout, not wait_for: it never drops a cancellation.
            async with asyncio.timeout(max(0.0, deadline - store._clock())) as bound:
                await ticket.future
        except TimeoutError:
            queued = reads.withdraw(ticket)
            if bound.expired():
                raise self._late(key, store._bound, not queued) from None
            raise
        except BaseException:
            reads.withdraw(ticket)  # cancelled: raised on, and its call left out
            raise
        return outcome(ticket)

    async def _pumping(self) -> None:
        reads, free = self._reads, self._free
        try:
            while True:
                if free is not None:
                    await free()
                batch = reads.take()
                if batch is None:
                    return
                await self._send(batch)
                # The callers just answered run first (one turn of the loop): what they send
                # next joins the next batch instead of going out alone ahead of it.
                await asyncio.sleep(0)
        except BaseException as error:
            # Cancelled (the loop is closing) or a bug: nobody may wait for a pump that is gone.
            for ticket in [*reads.abandon(error)]:
                _wake(ticket)
            raise
        finally:
            self._pump = None

    async def _send(self, batch: list[_TaskTicket]) -> None:
        try:
            settle(batch, await self._many(list(batch), max(t.deadline for t in batch)))
        except BaseException as error:
            for ticket in batch:
                ticket.error = error
            if not isinstance(error, Exception):
                raise
        finally:
            for ticket in batch:
                _wake(ticket)


def _wake(ticket: _TaskTicket) -> None:
    if not ticket.future.done():  # a caller that gave up cancelled its future
        ticket.future.set_result(None)


__all__ = ["MAX_BATCH", "PUMP_IDLE", "Reads", "TaskReads", "ThreadReads", "Ticket",
           "late_read", "overdue", "settle"]
