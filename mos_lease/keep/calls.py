"""The supervisor's store calls, each given a time limit: a campaign call waited for until
its limit, and the renewal batches a turn keeps in flight, given up on at theirs (or
sooner, on a renewal connection the other outpaces: :class:`~mos_lease.keep.lanes.Lanes`).
:class:`Calls` for the thread supervisor, :class:`AsyncCalls` for the asyncio one, with one
call shape (:mod:`mos_lease.keep.runner`).

A batch on one of two renewal connections still running at half its time may have a hung
connection or a slow database; with the other connection idle, nothing says which. So its
renewals are sent there too (a hedge), and whichever call returns first is judged: a hung
connection costs no lease; a slow database one extra call, then none until a batch is
prompt again, and no batch waits behind the hedge left running (:meth:`Lanes.wasted`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

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
from mos_lease.keep.lanes import Lanes, answered
from mos_lease.keep.slots import RenewalBatch
from mos_lease.keep.turn import Ended
from mos_lease.results import LeaseResult
from mos_lease.stats import SupervisorCounts

A = TypeVar("A")
T = TypeVar("T")

NAME = "mos-lease-supervisor"
"""The name of the supervisor's thread or task; its call threads are named after it."""

POLL: Final = 0.01
"""Seconds between a thread supervisor's looks at a batch and its hedge (it cannot wait
for the first of two threads)."""


class Calls:
    """The thread supervisor's store calls. A campaign call runs on a short-lived daemon
    thread of its own, abandoned past its limit (:func:`mos_lease.bounded.bounded`). A
    renewal batch is primed when the turn asks for it (its leases checked, its statement
    built), and its call starts once the one before it on its coordinator was collected:
    one renewal thread per coordinator, while the supervisor's thread primes the next batch
    and judges the last (the client's work overlapping the database's)."""

    __slots__ = ("_clock", "_counts", "_lanes", "_queued", "_renewers", "_started")

    def __init__(self, clock: Callable[[], float],
                 renewers: Sequence[ConnectorLeaseCoordinator] = (),
                 counts: SupervisorCounts | None = None) -> None:
        self._clock = clock
        self._renewers = tuple(renewers)
        self._counts = SupervisorCounts() if counts is None else counts  # hedges
        self._queued: collections.deque[_Batch] = collections.deque()
        # By coordinator (its id): the batch whose thread may still run.
        self._started: dict[int, _Batch] = {}
        self._lanes = Lanes.of(clock, self._renewers)  # kept past the turn

    def bounded(self, call: Callable[[A], T], argument: A, timeout: float,
                late: Callable[[T], object] | None = None) -> T | BaseException:
        """``call(argument)``'s result, the exception it raised, or
        :data:`~mos_lease.bounded.OVERDUE` after ``timeout`` seconds; the result of a
        call abandoned then goes to ``late``, on its thread, once it ends."""
        return bounded(lambda: call(argument), timeout, name=f"{NAME}-campaign", late=late)

    def renew(self, coordinator: ConnectorLeaseCoordinator, renew: RenewalBatch) -> object:
        """Prime ``renew``, start it unless a batch runs on ``coordinator``: its ticket."""
        try:
            batch = _Batch(coordinator.prime_heartbeat_many(renew.leases, ttl=renew.ttl),
                           lane=id(coordinator), renew=renew)
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
        queued never starts); running at ``patience``, whichever of it and its hedge returns
        first (``_hedged``). The next batch on its coordinator starts once it ends."""
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
        outcome: object = None
        if wait > 0.0 and patience < timeout:
            began = time.monotonic()
            if running.ended(patience):
                self._lanes.prompt()
            elif self._lanes.outpaced(ticket.lane, ticket.begun, [
                    (b.lane, b.begun, b.running.wait(0.0)) for b in self._started.values()
                    if b.running is not None and b is not ticket and b.running.done()]):
                wait = 0.0
            else:
                outcome = self._hedged(ticket, timeout - (time.monotonic() - began))
                wait = timeout - (time.monotonic() - began)
        if outcome is None:
            outcome = running.wait(wait)
            if not forsaken or outcome is not OVERDUE:  # given up for its lane: no news of it
                self._lanes.judge(ticket.lane, outcome, running, ticket.begun)
        self._ended(ticket)
        return outcome

    def _hedged(self, ticket: _Batch, wait: float) -> object:
        """Send ``ticket``'s renewals on an idle coordinator too and wait, ``wait`` seconds at
        most, for either call to return its results: the hedge's if they came first
        (``ticket`` is then given up on, or failed, and judged), else ``None`` (``ticket``
        returned first, or nothing did: collect judges it)."""
        hedge = self._hedge(ticket)
        if hedge is None:
            return None
        first, second = ticket.running, hedge.running
        assert first is not None and second is not None
        end = time.monotonic() + wait
        while (left := end - time.monotonic()) > 0:
            if second.done():
                outcome = second.wait(0.0)
                self._lanes.judge(hedge.lane, outcome, second, hedge.begun)
                self._ended(hedge)
                if not answered(outcome):
                    return None
                given_up = first.wait(0.0)
                if answered(given_up):
                    return None  # both returned: the first's, judged by collect
                self._lanes.judge(ticket.lane, given_up, first, ticket.begun)
                return outcome
            if not first.done():
                first.ended(min(POLL, left))
            elif answered(first.wait(0.0)):
                self._lanes.wasted()
                break
            else:  # the first failed: wait for the hedge alone
                second.ended(left)
        if not second.done():  # its connection is taken until it ends
            self._lanes.lingers(hedge.lane, second)
        self._ended(hedge)
        return None

    def _hedge(self, ticket: _Batch) -> _Batch | None:
        """``ticket``'s renewals started on an idle coordinator (:meth:`Lanes.idle`), if any."""
        idle = self._lanes.idle(self._renewers, [ticket.lane, *self._started,
                                                 *(b.lane for b in self._queued)])
        renew = ticket.renew
        if idle is None or renew is None:
            return None
        try:
            hedge = _Batch(idle.prime_heartbeat_many(renew.leases, ttl=renew.ttl),
                           lane=id(idle), renew=renew)
        except Exception:
            return None  # primed once already: a bug, which the batch itself reports
        self._counts.hedges += 1
        self._start(hedge)
        return hedge

    def _ended(self, batch: _Batch) -> None:
        """``batch`` was collected: the next batch on its coordinator may start."""
        if self._started.get(batch.lane) is batch:
            del self._started[batch.lane]
            following = next((b for b in self._queued if b.lane == batch.lane), None)
            if following is not None and not self._lanes.forsaken(batch.lane):
                self._queued.remove(following)
                self._start(following)

    def stuck(self, coordinator: object) -> bool:
        """Whether to send no batch to ``coordinator`` now (:meth:`Lanes.avoided`)."""
        return self._lanes.avoided(id(coordinator))

    def clear(self) -> None:
        """Forget the batches of a turn that ended without collecting them."""
        self._queued.clear()
        self._started.clear()

    def _start(self, batch: _Batch) -> None:
        assert batch.rest is not None
        batch.begun = self._clock()
        batch.running = start(_timed(batch.rest, self._clock), name=f"{NAME}-renewal")
        self._started[batch.lane] = batch


def _timed(call: Callable[[], list[LeaseResult]], clock: Callable[[], float]
           ) -> Callable[[], Ended]:
    """``call`` answering :class:`~mos_lease.keep.turn.Ended`: its outcome and end."""
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

    __slots__ = ("begun", "lane", "outcome", "renew", "rest", "running")

    def __init__(self, rest: Callable[[], list[LeaseResult]] | None,
                 outcome: object = None, lane: int = 0,
                 renew: RenewalBatch | None = None) -> None:
        self.rest = rest  # None: answered already (priming raised ``outcome``)
        self.outcome = outcome
        self.lane = lane
        self.renew = renew  # what a hedge sends again
        self.running: Running[Ended] | None = None
        self.begun = 0.0  # when its call started, on the supervisor's clock


class AsyncCalls:
    """The asyncio supervisor's store calls, each a task of its own: a campaign call is
    waited for until its limit (:func:`mos_lease.bounded.bounded_async`), a renewal batch
    started at once and waited for by its collect. A call given up on is cancelled and kept
    referenced until it ends, never trusted later."""

    __slots__ = ("_abandoned", "_clock", "_counts", "_lanes", "_renewers", "_started")

    def __init__(self, clock: Callable[[], float],
                 renewers: Sequence[AsyncConnectorLeaseCoordinator] = (),
                 counts: SupervisorCounts | None = None) -> None:
        self._clock = clock
        self._renewers = tuple(renewers)
        self._counts = SupervisorCounts() if counts is None else counts
        self._abandoned: set[asyncio.Future[Any]] = set()
        # Renewals not yet collected: each one's coordinator's id, start and batch.
        self._started: dict[asyncio.Future[Any], tuple[int, float, RenewalBatch]] = {}
        self._lanes = Lanes.of(clock, self._renewers)

    async def bounded(self, call: Callable[[A], Awaitable[T]], argument: A, timeout: float,
                      late: Callable[[T], Awaitable[object]] | None = None
                      ) -> T | BaseException:
        """As :meth:`Calls.bounded`. Given ``late``, a call given up on is not cancelled (one
        cancelled mid-write may have committed; one left to end says what it did): it runs
        on, a task kept until it ends, and its result goes to ``late``. A cancelled caller
        waits (``timeout`` more at most) until the call has ended and ``late`` has its
        result, so that nothing it started still runs once it goes on."""
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
        its result; left to the background past ``limit``, or on a second cancellation."""
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
        self._started[running] = (id(coordinator), self._clock(), renew)
        return running

    async def collect(self, ticket: object, timeout: float, patience: float) -> object:
        """As :meth:`Calls.collect`."""
        assert isinstance(ticket, asyncio.Future)
        lane, begun, renew = self._started.pop(ticket)
        forsaken = self._lanes.forsaken(lane)
        wait = 0.0 if forsaken else timeout
        if wait > 0.0 and patience < timeout:
            began = time.monotonic()
            try:
                done, _ = await asyncio.wait((ticket,), timeout=max(patience, 0.0))
            except asyncio.CancelledError:
                abandon(ticket, self._abandoned)
                raise
            if done:
                self._lanes.prompt()
            elif self._lanes.outpaced(lane, begun, [
                    (other, started, running.result()) for running, (other, started, _)
                    in self._started.items() if running.done() and not running.cancelled()
                    and running.exception() is None]):
                wait = 0.0
            elif not done:
                hedged = await self._hedged(ticket, lane, begun, renew,
                                            timeout - (time.monotonic() - began))
                if hedged is not None:
                    return hedged
                wait = timeout - (time.monotonic() - began)
        outcome = await bounded_wait(ticket, wait, self._abandoned)
        # Given up on, it is cancelled, but a hung connection may not let it end.
        if not forsaken or outcome is not OVERDUE:
            self._lanes.judge(lane, outcome, ticket, begun)
        return outcome

    async def _hedged(self, ticket: asyncio.Future[Any], lane: int, begun: float,
                      renew: RenewalBatch, wait: float) -> object:
        """As :meth:`Calls._hedged`; a hedge still running when ``ticket`` returns its
        results, or at the end of ``wait``, is cancelled (no verdict on its coordinator)."""
        idle = self._lanes.idle(self._renewers,
                                [lane, *(other for other, _, _ in self._started.values())])
        if idle is None:
            return None
        hedge = asyncio.ensure_future(self._timed(idle.heartbeat_many(renew.leases,
                                                                      ttl=renew.ttl)))
        self._counts.hedges += 1
        started, end = self._clock(), time.monotonic() + wait
        waiting = {ticket, hedge}
        try:
            while waiting and (left := end - time.monotonic()) > 0:
                done, _ = await asyncio.wait(waiting, timeout=min(left, 1e9),
                                             return_when=asyncio.FIRST_COMPLETED)
                waiting -= done
                if ticket in done and answered(ticket.result()):
                    if not hedge.done():
                        self._lanes.wasted()
                    break  # the first returned: its own, judged by collect
                if hedge in done:
                    outcome = hedge.result()
                    self._lanes.judge(id(idle), outcome, hedge, started)
                    if answered(outcome):
                        if ticket in waiting:
                            abandon(ticket, self._abandoned)
                        given_up = ticket.result() if ticket.done() else OVERDUE
                        self._lanes.judge(lane, given_up, ticket, begun)
                        return outcome
                    if ticket.done():
                        break
        except asyncio.CancelledError:
            abandon(hedge, self._abandoned)
            abandon(ticket, self._abandoned)
            raise
        if not hedge.done():
            self._lanes.lingers(id(idle), hedge)  # its connection is taken until it ends
            abandon(hedge, self._abandoned)
        return None

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
