"""Where the thread and the asyncio supervisor differ, each difference behind one small pair
with the same call shape, so that the supervisor itself is written once
(:mod:`mos_lease.keep.runner`):

* :class:`Wakeup` / :class:`AsyncWakeup`: the loop's sleep, ended early by an ``add()``, a
  ``close()`` or the notice confirmer's thread (``set_from_thread``);
* :class:`Calls` / :class:`AsyncCalls`: a campaign call given a time limit (on a thread, or
  as a task, of its own) and the renewal batches a turn keeps in flight;
* :class:`Worker` / :class:`AsyncWorker`: the one thread, or task, the loop runs on.

The asyncio runner is the source; ``tools/async_to_sync.py`` generates the thread one from
it, dropping ``async`` and ``await`` and naming the synchronous twin of each pair.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from mos_lease.bounded import (
    OVERDUE,
    Running,
    abandon,
    bounded,
    bounded_async,
    bounded_wait,
    start,
)
from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator
from mos_lease.keep.lanes import Lanes
from mos_lease.keep.slots import RenewalBatch
from mos_lease.keep.turn import Ended
from mos_lease.results import LeaseResult

A = TypeVar("A")
T = TypeVar("T")

NAME = "mos-lease-supervisor"
"""The name of the supervisor's thread or task; its call threads are named after it."""


class Wakeup:
    """The thread supervisor's sleep: :meth:`wait` ends early once :meth:`set` is called,
    from any thread."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def set_from_thread(self) -> bool:
        """:meth:`set`, from another thread; whether the loop could be woken."""
        self._event.set()
        return True

    def clear(self) -> None:
        self._event.clear()

    def wait(self, seconds: float) -> None:
        self._event.wait(min(seconds, threading.TIMEOUT_MAX))  # math.inf is too long for it


class AsyncWakeup:
    """The asyncio supervisor's sleep: :meth:`wait` ends early once :meth:`set` is called on
    the loop, or :meth:`set_from_thread` from another thread. The event belongs to the loop
    of the first :meth:`set` made on one (the first ``add()``): another thread wakes it
    through that loop."""

    __slots__ = ("_event", "_loop")

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def set(self) -> None:
        self._event.set()
        if self._loop is None:
            with contextlib.suppress(RuntimeError):  # driven by hand, outside a loop
                self._loop = asyncio.get_running_loop()

    def set_from_thread(self) -> bool:
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop has closed: nobody will make the read
            return False
        return True

    def clear(self) -> None:
        self._event.clear()

    async def wait(self, seconds: float) -> None:
        if math.isinf(seconds):
            await self._event.wait()
            return
        try:
            async with asyncio.timeout(seconds):
                await self._event.wait()
        except TimeoutError:
            pass


class Calls:
    """The thread supervisor's store calls. A campaign call runs on a short-lived daemon
    thread of its own, abandoned past its limit (:func:`mos_lease.bounded.bounded`).

    A renewal batch is primed when the turn asks for it (its leases checked and its
    statement built, on the supervisor's thread), and its store call starts once the one
    before it on the same coordinator was collected: one renewal thread per renewal
    coordinator however many batches are in flight, while the supervisor's thread primes
    the next batch and judges the last (the client's work overlapping the database's)."""

    __slots__ = ("_clock", "_lanes", "_queued", "_started")

    def __init__(self, clock: Callable[[], float], lanes: int = 1) -> None:
        self._clock = clock
        self._queued: collections.deque[_Batch] = collections.deque()
        # By coordinator (its id): the batch whose thread may still run.
        self._started: dict[int, _Batch] = {}
        self._lanes = Lanes(clock, lanes)  # kept past the turn

    def bounded(self, call: Callable[[A], T], argument: A, timeout: float,
                late: Callable[[T], object] | None = None) -> T | BaseException:
        """``call(argument)``'s result, the exception it raised, or
        :data:`~mos_lease.bounded.OVERDUE` after ``timeout`` seconds; the result of a
        call abandoned then goes to ``late``, on its thread, once it ends."""
        return bounded(lambda: call(argument), timeout, name=f"{NAME}-campaign", late=late)

    def renew(self, coordinator: ConnectorLeaseCoordinator, renew: RenewalBatch) -> object:
        """Prime the batch ``renew`` and start it if no other runs on ``coordinator``: its
        ticket."""
        try:
            batch = _Batch(coordinator.prime_heartbeat_many(renew.leases, ttl=renew.ttl),
                           lane=id(coordinator))
        except Exception as error:  # bad input: the batch's outcome, as its call's would be
            return _Batch(None, error)
        if batch.lane in self._started:
            self._queued.append(batch)
        else:
            self._start(batch)
        return batch

    def collect(self, ticket: object, timeout: float, patience: float) -> object:
        """The batch's results, the exception its call raised, or ``OVERDUE`` (abandoned)
        after ``timeout`` seconds, after ``patience`` if its coordinator is outpaced
        (:meth:`Lanes.outpaced`), at once if it is forsaken (:meth:`Lanes.forsaken`; one
        queued never starts). The next batch on its coordinator starts once this one ends."""
        assert isinstance(ticket, _Batch)
        if ticket.rest is None:
            return ticket.outcome
        forsaken = self._lanes.forsaken(ticket.lane)
        if ticket.running is None and forsaken:
            self._queued.remove(ticket)
            return OVERDUE
        while ticket.running is None:  # queued behind batches collected before it
            self._start(self._queued.popleft())
        running, wait = ticket.running, 0.0 if forsaken else timeout
        if wait > 0.0 and patience < timeout:
            began = time.monotonic()
            outpaced = not running.ended(patience) and self._lanes.outpaced(
                ticket.lane, ticket.begun, [(b.lane, b.begun, b.running.wait(0.0)) for b in
                                            self._started.values() if b.running is not None
                                            and b is not ticket and b.running.done()])
            wait = 0.0 if outpaced else timeout - (time.monotonic() - began)
        outcome = running.wait(wait)
        if not forsaken or outcome is not OVERDUE:  # given up for its lane: no news of it
            self._lanes.judge(ticket.lane, outcome, running, ticket.begun)
        if self._started.get(ticket.lane) is ticket:
            del self._started[ticket.lane]
            following = next((b for b in self._queued if b.lane == ticket.lane), None)
            if following is not None and not self._lanes.forsaken(ticket.lane):
                self._queued.remove(following)
                self._start(following)
        return outcome

    def stuck(self, coordinator: object) -> bool:
        """Whether to send no batch to ``coordinator`` now (:meth:`Lanes.avoided`)."""
        return self._lanes.avoided(id(coordinator))

    def clear(self) -> None:
        """Forget the batches of a turn that ended without collecting them (never started,
        or abandoned as at their limit)."""
        self._queued.clear()
        self._started.clear()

    def _start(self, batch: _Batch) -> None:
        assert batch.rest is not None
        batch.begun = self._clock()
        batch.running = start(_timed(batch.rest, self._clock), name=f"{NAME}-renewal")
        self._started[batch.lane] = batch


def _timed(call: Callable[[], list[LeaseResult]], clock: Callable[[], float]
           ) -> Callable[[], Ended]:
    """``call`` answering :class:`~mos_lease.keep.turn.Ended`: its outcome, and when it
    returned."""
    def timed() -> Ended:
        outcome: object
        try:
            outcome = call()
        except Exception as error:
            outcome = error
        return Ended(outcome, clock())
    return timed


class _Batch:
    """A renewal batch primed on the supervisor's thread, whose store call runs on a thread
    of its own once started, one at a time on its coordinator (``lane``: its id)."""

    __slots__ = ("begun", "lane", "outcome", "rest", "running")

    def __init__(self, rest: Callable[[], list[LeaseResult]] | None,
                 outcome: object = None, lane: int = 0) -> None:
        self.rest = rest  # None: answered already (priming raised ``outcome``)
        self.outcome = outcome
        self.lane = lane
        self.running: Running[Ended] | None = None
        self.begun = 0.0  # when its call started, on the supervisor's clock


class AsyncCalls:
    """The asyncio supervisor's store calls, each a task of its own: a campaign call is
    waited for until its limit (:func:`mos_lease.bounded.bounded_async`), a renewal batch
    started at once and waited for by its collect. A call given up on is cancelled and kept
    referenced until it ends, never trusted later."""

    __slots__ = ("_abandoned", "_clock", "_lanes", "_started")

    def __init__(self, clock: Callable[[], float], lanes: int = 1) -> None:
        self._clock = clock
        self._abandoned: set[asyncio.Future[Any]] = set()
        # Renewals not yet collected, each with its coordinator's id and its start.
        self._started: dict[asyncio.Future[Any], tuple[int, float]] = {}
        self._lanes = Lanes(clock, lanes)

    async def bounded(self, call: Callable[[A], Awaitable[T]], argument: A, timeout: float,
                      late: Callable[[T], Awaitable[object]] | None = None
                      ) -> T | BaseException:
        """As :meth:`Calls.bounded`. Given ``late``, a call given up on is not cancelled (a
        call cancelled mid-write may have committed it; one left to end says what it did):
        past ``timeout`` it runs on (the store bounds it) and its result goes to ``late``, as
        a task kept until it ends, as a thread's does; when the caller is cancelled, the
        cancellation waits until the call has ended and ``late`` has had its result (at
        most ``timeout`` more), so that nothing it started is still running once it goes
        on."""
        if late is None:
            return await bounded_async(call(argument), timeout, self._abandoned)
        running = asyncio.ensure_future(call(argument))
        limit = min(max(timeout, 0.0), 1e9)
        try:
            done, _ = await asyncio.wait((running,), timeout=limit)
        except asyncio.CancelledError:
            await self._settle(running, late, limit)
            raise
        if not done:
            self._late(running, late)
            overdue: T | BaseException = OVERDUE
            return overdue
        try:
            return running.result()
        except Exception as error:
            return error

    async def _settle(self, running: asyncio.Future[T],
                      late: Callable[[T], Awaitable[object]], limit: float) -> None:
        """Wait (the caller is being cancelled) for ``running`` to end and ``late`` to take
        its result; left to the background if it takes longer than ``limit``, or if the
        caller is cancelled once more."""
        try:
            done, _ = await asyncio.wait((running,), timeout=limit)
            if not done:
                self._late(running, late)
            elif not running.cancelled() and running.exception() is None:
                await late(running.result())
        except asyncio.CancelledError:
            if not running.done():
                self._late(running, late)
            raise

    def _late(self, running: asyncio.Future[T], late: Callable[[T], Awaitable[object]]
              ) -> None:
        def after(ended: asyncio.Future[T]) -> None:
            self._abandoned.discard(ended)
            if ended.cancelled() or ended.exception() is not None:
                return
            follow = asyncio.ensure_future(late(ended.result()))
            self._abandoned.add(follow)
            follow.add_done_callback(self._abandoned.discard)

        self._abandoned.add(running)
        running.add_done_callback(after)

    def renew(self, coordinator: AsyncConnectorLeaseCoordinator, renew: RenewalBatch) -> object:
        running = asyncio.ensure_future(self._timed(
            coordinator.heartbeat_many(renew.leases, ttl=renew.ttl)))
        self._started[running] = (id(coordinator), self._clock())
        return running

    async def collect(self, ticket: object, timeout: float, patience: float) -> object:
        """As :meth:`Calls.collect`."""
        assert isinstance(ticket, asyncio.Future)
        lane, begun = self._started.pop(ticket)
        forsaken = self._lanes.forsaken(lane)
        wait = 0.0 if forsaken else timeout
        if wait > 0.0 and patience < timeout:
            began = time.monotonic()
            try:
                done, _ = await asyncio.wait((ticket,), timeout=max(patience, 0.0))
            except asyncio.CancelledError:
                abandon(ticket, self._abandoned)
                raise
            outpaced = not done and self._lanes.outpaced(lane, begun, [
                (other, started, running.result()) for running, (other, started)
                in self._started.items() if running.done() and not running.cancelled()
                and running.exception() is None])
            wait = 0.0 if outpaced else timeout - (time.monotonic() - began)
        outcome = await bounded_wait(ticket, wait, self._abandoned)
        # Given up on, it is cancelled, but a hung connection may not let it end.
        if not forsaken or outcome is not OVERDUE:
            self._lanes.judge(lane, outcome, ticket, begun)
        return outcome

    async def _timed(self, call: Awaitable[list[LeaseResult]]) -> Ended:
        outcome: object
        try:
            outcome = await call
        except Exception as error:
            outcome = error
        return Ended(outcome, self._clock())

    def stuck(self, coordinator: object) -> bool:
        """As :meth:`Calls.stuck`."""
        return self._lanes.avoided(id(coordinator))

    def clear(self) -> None:
        """A turn cut short (cancelled, or a bug) leaves no renewal running unwatched."""
        for running in self._started:
            abandon(running, self._abandoned)
        self._started.clear()


class Worker:
    """The thread the thread supervisor's loop runs on, started by the first ``add()``."""

    __slots__ = ("_lock", "_thread")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, run: Callable[[], object], name: str = NAME) -> None:
        """Run ``run`` on a daemon thread named ``name``, unless it was started already."""
        if self._thread is None:
            with self._lock:  # two threads adding the first bindings start one thread
                if self._thread is None:
                    self._thread = threading.Thread(target=run, daemon=True, name=name)
                    self._thread.start()

    def stop(self, timeout: float | None) -> None:
        """Wait for the thread to end (it was told to: the supervisor is closing), at most
        ``timeout`` seconds; not on the thread itself."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


class AsyncWorker:
    """The task the asyncio supervisor's loop runs as, started by the first ``add()``."""

    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def start(self, run: Callable[[], Coroutine[Any, Any, None]], name: str = NAME) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(run(), name=name)

    async def stop(self, timeout: float | None) -> None:
        """Cancel the task and wait for it to end, at most ``timeout`` seconds; not from
        the task itself."""
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            # Waited for without awaiting it, so a cancellation of the caller is not lost
            # (the asyncio keeper's stop() explains why).
            await asyncio.wait((task,), timeout=timeout)
