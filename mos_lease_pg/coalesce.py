"""Coalesced reads: loads that overlap in time on one store share one round trip.

A gateway validates for many bindings at once, and every validation rereads its lease:
read one at a time, N reads cost N round trips in turn on the store's connection;
coalesced (group commit, applied to reads), one per batch.

    a load arrives   no read in flight on the store: it goes out at once, alone, as the
                     ordinary ``load.sql`` statement (no wait, no queue, no allocation).
                     A read in flight: the load queues.
    a read returns   whatever queued meanwhile goes out together as one statement
                     (``load_many.sql``: the keys unnested, joined to the lease table, each
                     row with its key's position and the database time), sent by the pump
                     (a thread of the sync store, a task of the asyncio store's loop).

What each caller is told does not change:

* **After its call began.** A load queues only after its caller called, and a batch takes
  only loads queued before it is sent, so every read is sent after its caller's call began:
  a takeover committed before the call is seen, as a lone read would see it.
* **The same columns, the same time rule** as ``load.sql``: each key's row (or none) and the
  database clock read in the same statement, after the statement's snapshot. The flows judge
  each answer on its own (expiry, holder, scopes, the in-flight rule: time spent queued is in
  flight, measured by the caller as today); a denial writes its own audit row as today.
* **Each caller's own bound.** A caller waits for its answer only until its own deadline
  (the call bound, ``mos_lease.operation``: a validation's counts from its start); then it
  fails closed with ``StoreUnavailable``, and its key is dropped from the queue if it has
  not gone out. The batch statement is bounded by the latest deadline of the loads it
  carries (the pump is no caller), so it never cuts a caller shorter than its own bound.
* **Failures.** A failure of the shared statement is each caller's failure: the store's
  translation (a lost connection resent once for a read, ``StoreUnavailable``,
  ``ConfigurationError``, ...), raised to each caller as a copy of its own.
* **Cancellation** (asyncio) of a queued caller withdraws its load and is raised on, never
  swallowed; the shared round trip is the pump's, so no caller's cancellation cancels it.
  A lone read is its caller's own, cancelled with it as today; what queued behind it goes
  out all the same.

The rules (when a load goes alone, what a batch takes, who is told what) are :class:`Reads`,
written once; :class:`ThreadReads` and :class:`TaskReads` only add how a caller waits and
where the pump runs. Every kind of load (a validation's, a grant issue's, a takeover's read)
goes through the same queue: all of them are the same read, judged by their callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
from collections.abc import Awaitable, Sequence
from datetime import timedelta
from typing import Any, Final, Generic, Protocol, TypeVar

from mos_lease.clock import MonotonicClock
from mos_lease.errors import StoreUnavailable
from mos_lease.identity import LeaseIdentity
from mos_lease.records import Snapshot
from mos_lease_pg import statements
from mos_lease_pg.statements import Call

T = TypeVar("T")

MAX_BATCH: Final = 1000  # the most keys one statement reads; more wait for the next one
PUMP_IDLE: Final = 5.0  # seconds the sync store's pump thread waits for a batch, then ends


class Ticket:
    """One queued load: its key, its caller's deadline (on the store's clock) and, once the
    batch carrying it returned, its answer or the error to raise."""

    __slots__ = ("deadline", "error", "identity", "snapshot")

    def __init__(self, identity: LeaseIdentity, deadline: float) -> None:
        self.identity = identity
        self.deadline = deadline
        self.snapshot: Snapshot | None = None
        self.error: BaseException | None = None


K = TypeVar("K", bound=Ticket)


class Reads(Generic[K]):
    """The rules of coalescing, without I/O or locks: the sync store calls them under its
    lock, the asyncio store on its loop.

    ``busy`` is true while a read (a lone load or a batch) is in flight or queued loads wait
    for the pump to send them: at most one read of a store is in flight at a time."""

    __slots__ = ("busy", "waiting")

    def __init__(self) -> None:
        self.busy = False
        self.waiting: list[K] = []

    def alone(self) -> bool:
        """Whether a load arriving now goes out at once, alone (nothing is in flight)."""
        if self.busy:
            return False
        self.busy = True
        return True

    def returned(self) -> bool:
        """A lone load returned (or failed): True if loads queued meanwhile, which the pump
        must now send (the store stays busy); False if none did (the store is idle)."""
        if self.waiting:
            return True
        self.busy = False
        return False

    def take(self) -> list[K] | None:
        """The pump's next batch: the loads queued so far (at most :data:`MAX_BATCH`), or
        ``None`` when none are left (the store is idle)."""
        waiting = self.waiting
        if not waiting:
            self.busy = False
            return None
        if len(waiting) <= MAX_BATCH:
            self.waiting = []
            return waiting
        batch = waiting[:MAX_BATCH]
        del waiting[:MAX_BATCH]
        return batch

    def withdraw(self, ticket: K) -> None:
        """A caller gave up (its deadline, a cancellation): its load, if not sent yet, is
        left out of the next batch."""
        # Not found: sent already, and its answer is dropped when it comes.
        with contextlib.suppress(ValueError):
            self.waiting.remove(ticket)

    def abandon(self, error: BaseException) -> list[K]:
        """The pump ended abnormally: every queued load fails with ``error`` (returned, for
        the shell to wake their callers) and the store is idle."""
        left, self.waiting = self.waiting, []
        for ticket in left:
            ticket.error = error
        self.busy = False
        return left


def batch_call(batch: Sequence[Ticket], offset: timedelta,
               schema: str) -> tuple[Call[Any], bool]:
    """The statement of ``batch``, and whether it answers a list (``load_many``) or one
    snapshot (a batch of one goes out as the ordinary load)."""
    if len(batch) == 1:
        return statements.load(batch[0].identity, offset, schema=schema), False
    return statements.load_many([t.identity for t in batch], offset, schema=schema), True


def settle(batch: Sequence[Ticket], answer: object, many: bool) -> None:
    """Hand each load of ``batch`` its snapshot from the batch's answer."""
    if not many:
        assert isinstance(answer, Snapshot)
        batch[0].snapshot = answer
        return
    assert isinstance(answer, list)
    for ticket, snapshot in zip(batch, answer, strict=True):
        ticket.snapshot = snapshot


def own_copy(error: BaseException) -> BaseException:
    """A copy of ``error`` for one caller: one exception object raised in several threads
    or tasks at once would collect all their tracebacks."""
    try:
        mine = copy.copy(error)
    except Exception:  # an exception that cannot be rebuilt from its args: the shared one
        return error
    return mine if type(mine) is type(error) and str(mine) == str(error) else error


def outcome(ticket: Ticket) -> Snapshot:
    """The answer of a settled load, or its error raised (a copy, caused by the shared one)."""
    error = ticket.error
    if error is not None:
        mine = own_copy(error)
        if mine is error:
            raise error
        raise mine from error
    assert ticket.snapshot is not None
    return ticket.snapshot


def overdue(bound: float) -> StoreUnavailable:
    """The error of a caller whose bound passed while its load waited for a shared read."""
    return StoreUnavailable(
        f"load: no reply within the {bound:g} s call bound (queued behind the store's read "
        "in flight)")


class _Store(Protocol):
    """What the shells use of a PostgreSQL store (``mos_lease_pg.store``)."""

    _clock: MonotonicClock
    _bound: float

    @property
    def _offset(self) -> timedelta: ...

    @property
    def _schema(self) -> str: ...

    def _deadline(self, deadline: float | None) -> float: ...


class SyncStore(_Store, Protocol):
    def _run(self, call: Call[T], *, covers: Any = None, deadline: float | None = None
             ) -> T: ...


class AsyncStore(_Store, Protocol):
    def _run(self, call: Call[T], *, covers: Any = None, deadline: float | None = None
             ) -> Awaitable[T]: ...


class _ThreadTicket(Ticket):
    __slots__ = ("ready",)

    def __init__(self, identity: LeaseIdentity, deadline: float) -> None:
        super().__init__(identity, deadline)
        # Held until the answer is in; a plain lock is the cheapest thing a thread can wait
        # on with a timeout.
        self.ready = threading.Lock()
        self.ready.acquire()


class ThreadReads:
    """The sync store's coalesced loads: callers are threads, the pump a daemon thread of
    the store's own that ends after :data:`PUMP_IDLE` seconds without work."""

    __slots__ = ("_lock", "_pump", "_reads", "_store", "_wake")

    def __init__(self, store: SyncStore) -> None:
        self._store = store
        self._reads: Reads[_ThreadTicket] = Reads()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pump: threading.Thread | None = None

    def load(self, identity: LeaseIdentity) -> Snapshot:
        """The row of ``identity`` and the database time, read after this call began."""
        store = self._store
        deadline = store._deadline(None)
        reads = self._reads
        with self._lock:
            ticket = None if reads.alone() else _ThreadTicket(identity, deadline)
            if ticket is not None:
                reads.waiting.append(ticket)
        if ticket is None:
            try:
                return store._run(statements.load(identity, store._offset,
                                                  schema=store._schema), deadline=deadline)
            finally:
                with self._lock:
                    if reads.returned():
                        self._start_pump()
        if not ticket.ready.acquire(timeout=max(0.0, deadline - store._clock())):
            with self._lock:
                reads.withdraw(ticket)
            raise overdue(store._bound)
        return outcome(ticket)

    def _start_pump(self) -> None:
        # Called under the lock, with loads queued and the store busy: the pump sends them.
        if self._pump is not None:
            self._wake.notify()
            return
        self._pump = threading.Thread(target=self._pumping, name="mos-lease-reads",
                                      daemon=True)
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
        store = self._store
        call, many = batch_call(batch, store._offset, store._schema)
        try:
            settle(batch, store._run(call, deadline=max(t.deadline for t in batch)), many)
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

    def __init__(self, identity: LeaseIdentity, deadline: float,
                 future: asyncio.Future[None]) -> None:
        super().__init__(identity, deadline)
        self.future = future


class TaskReads:
    """The asyncio store's coalesced loads: callers are tasks, the pump a task of the loop
    started when loads queued behind a lone one, ending when none are left."""

    __slots__ = ("_pump", "_reads", "_store")

    def __init__(self, store: AsyncStore) -> None:
        self._store = store
        self._reads: Reads[_TaskTicket] = Reads()
        self._pump: asyncio.Task[None] | None = None  # kept: the loop holds tasks weakly

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        """As :meth:`ThreadReads.load`."""
        store = self._store
        deadline = store._deadline(None)
        reads = self._reads
        if reads.alone():
            try:
                return await store._run(statements.load(identity, store._offset,
                                                        schema=store._schema),
                                        deadline=deadline)
            finally:
                # Also when this caller is cancelled: the loads behind it go out regardless.
                if reads.returned():
                    self._pump = asyncio.get_running_loop().create_task(self._pumping())
        ticket = _TaskTicket(identity, deadline, asyncio.get_running_loop().create_future())
        reads.waiting.append(ticket)
        try:
            # asyncio.timeout, not wait_for: it never drops a cancellation.
            async with asyncio.timeout(max(0.0, deadline - store._clock())) as bound:
                await ticket.future
        except TimeoutError:
            reads.withdraw(ticket)
            if bound.expired():
                raise overdue(store._bound) from None
            raise
        except BaseException:
            reads.withdraw(ticket)  # cancelled: raised on, and its load left out
            raise
        return outcome(ticket)

    async def _pumping(self) -> None:
        reads = self._reads
        try:
            while True:
                batch = reads.take()
                if batch is None:
                    return
                await self._send(batch)
                # The callers just answered run first (one turn of the loop): what they read
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
        store = self._store
        call, many = batch_call(batch, store._offset, store._schema)
        try:
            settle(batch, await store._run(call, deadline=max(t.deadline for t in batch)),
                   many)
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


__all__ = ["MAX_BATCH", "PUMP_IDLE", "Reads", "TaskReads", "ThreadReads", "Ticket"]
