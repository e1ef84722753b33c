"""The two supervisors, the asyncio one and the thread one: each performs the turn of
``turn.py`` (a generator of calls), each store call given its time limit, and runs the turn
again when something is due.

:class:`AsyncSupervisor` is the source. :class:`Supervisor` below it is generated from it by
``tools/async_to_sync.py`` (drop ``async`` and ``await``, name the synchronous twin of each
asyncio name), and ``tests/core/test_async_to_sync.py`` fails when the generated text is not
current. Where threads and asyncio really differ (waiting and waking, a call given a time
limit, the renewals in flight, the thread or task the loop runs on), the difference is a
pair with one call shape (:mod:`mos_lease.keep.primitives`, :mod:`mos_lease.keep.calls`).
"""

from __future__ import annotations

import asyncio
import queue
import random as _random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from datetime import timedelta

from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator
from mos_lease.events import EventHook
from mos_lease.fleet.membership import Fleet
from mos_lease.flowdrive import Drive, outcome_of, outcome_of_async
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.calls import AsyncCalls, Calls
from mos_lease.keep.changes import Change
from mos_lease.keep.fleet import FleetCall
from mos_lease.keep.granting import issue_grant
from mos_lease.keep.handover import HandoverResult, handover
from mos_lease.keep.keeper_calls import IssueGrantCall
from mos_lease.keep.notices import NoticeFeed
from mos_lease.keep.primitives import AsyncWakeup, AsyncWorker, Wakeup, Worker
from mos_lease.keep.schedule import DRAIN
from mos_lease.keep.slots import AcquireDue, ReadHolder, RenewalBatch, TakeoverDue
from mos_lease.keep.supervising import _Supervisor
from mos_lease.keep.turn import (
    IN_FLIGHT,
    Attempt,
    Call,
    Collect,
    ReleaseWon,
    Sleep,
    turn,
    turn_failed,
    unanswered_released,
    won,
)
from mos_lease.results import GrantResult, LeaseResult


class AsyncSupervisor(_Supervisor[AsyncConnectorLeaseCoordinator]):
    """Runs many bindings for a coordinator (:class:`~mos_lease.AsyncConnectorLeaseCoordinator`)
    as one asyncio task.

    Typical use::

        async with AsyncSupervisor(coordinator, on_change=print) as supervisor:
            supervisor.add(identity, "gateway-a", scopes=["tool:run"], ttl=30)
            ...
            lease = supervisor.lease(identity)  # the handle to mint grants with, or None

    Every held lease is renewed by one ``heartbeat_many`` round trip per 1,000 leases per
    tick, each judged on its own with the keeper's deadline rule, two batches in flight at
    once. Each store call is given a time limit
    (:class:`~mos_lease.keep.calls.AsyncCalls`): one hanging past the earliest
    local deadline is abandoned and that deadline still reported.
    The supervisor's task is started by the first :meth:`add` (call every method on its loop).
    ``on_change`` is called with each :data:`~mos_lease.supervisor.Change`, from the
    supervisor's task (or from the caller whose call found it). With ``background=False``
    nothing is started and :meth:`turn` drives the supervisor by hand; ``clock`` (default:
    the coordinator's ``monotonic``), ``sleep`` and ``random`` are injectable.

    ``notices``: one push source of lease changes for every binding (a
    ``mos_lease_pg.notices.LeaseNotices``; :class:`~mos_lease.keep.notices.NoticeFeed`).
    A notice for a binding is a hint: it asks the source's notice confirmer for a turn
    (coalesced per identity, rate-bounded for the process) in which the supervisor reads the
    holder; a takeover it confirms is reported as the binding's loss at once, and the
    campaign goes on from what was read. ``docs/keeping.md`` explains the campaign and
    counts the threads and tasks each supervisor runs.

    ``heartbeat_coordinator``: renew through this coordinator (a connection of its own),
    as a keeper does, or through these two, batch by batch in turn, so that the two
    batches in flight run at once on two connections. ``on_event``: the telemetry hook
    (:mod:`mos_lease.events`), sent a :class:`~mos_lease.events.Renewed` or
    :class:`~mos_lease.events.RenewalRetry` per lease of each renewal and a
    :class:`~mos_lease.events.Lost` per loss, as a keeper's is.
    """

    _kind = AsyncConnectorLeaseCoordinator
    # Renewal batches of a tick in flight at once (turn.IN_FLIGHT); the stateful
    # specification also runs it with one.
    _in_flight = IN_FLIGHT

    def __init__(self, coordinator: AsyncConnectorLeaseCoordinator, *,
                 on_change: Callable[[Change], object] | None = None,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[object]] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True, notices: NoticeFeed | None = None,
                 heartbeat_coordinator: AsyncConnectorLeaseCoordinator
                 | Sequence[AsyncConnectorLeaseCoordinator] | None = None,
                 on_event: EventHook | None = None, fleet: Fleet | None = None) -> None:
        self._wakeup = AsyncWakeup()  # before the notice listener, which may wake it at once
        super().__init__(coordinator, on_change=on_change, clock=clock, random=random,
                         background=background, notices=notices,
                         heartbeat_coordinator=heartbeat_coordinator, on_event=on_event,
                         fleet=fleet)
        self._sleep = sleep if sleep is not None else self._wakeup.wait
        self._calls = AsyncCalls(self._core.clock, self.renewers, self._counts)
        self._worker = AsyncWorker()

    def _started(self) -> None:
        self._wakeup.set()
        if self._background:
            self._worker.start(self._run, self._name)

    def _real_sleep(self) -> Callable[[float], Awaitable[object]]:
        return self._wakeup.wait

    def _wake_from_thread(self) -> bool:
        return self._wakeup.set_from_thread()

    async def _run(self) -> None:
        while not self._core.closing:
            self._wakeup.clear()  # before the turn reads the schedule: no add is missed
            try:
                await self.turn()
            except Exception as error:
                turn_failed(self._core, error)
                await self._sleep(0.1)

    async def turn(self) -> None:
        """One turn: renew what is due, make the campaign calls due, or sleep."""
        try:
            drive = Drive(turn(self._core, self._in_flight, len(self.renewers)), ())
            for call in drive:
                drive.send(await self._perform(call))
        finally:
            # A turn collects every batch it started; one cut short (cancelled, or a bug
            # part-way: turn_failed) leaves its batches behind, never to start or be
            # waited for.
            self._calls.clear()

    async def _perform(self, call: Call) -> object:
        if isinstance(call, Sleep):
            return await self._sleep(call.seconds)
        if isinstance(call, RenewalBatch):  # started now, waited for by its Collect
            self._counts.renewal(len(call.leases))
            return self._calls.renew(self._next_renewer(self._calls.stuck), call)
        if isinstance(call, Collect):
            return await self._calls.collect(call.ticket, call.timeout, call.patience)
        if isinstance(call, Attempt):
            return await self._calls.bounded(self._campaign, call, call.timeout,
                                             self._unanswered)
        if isinstance(call, FleetCall):
            return await self._calls.bounded(self._fleet, call, call.timeout)
        assert isinstance(call, ReleaseWon)
        self._counts.releases += 1
        try:
            return await self.coordinator.release(call.lease)
        except Exception as error:
            return error

    async def _unanswered(self, answer: object) -> None:
        """A campaign call's answer that came after its turn stopped waiting for it (the
        turn was cancelled, or the call ran past its limit): the schedule never saw it, so
        every lease it won is released here, whether or not its binding is still run."""
        for lease in won(answer):
            self._counts.releases += 1
            try:
                released: LeaseResult | Exception = await self.coordinator.release(lease)
            except Exception as error:
                released = error
            unanswered_released(lease, released)

    async def _fleet(self, call: FleetCall) -> object:
        return await call.run(self.coordinator)

    async def _campaign(self, attempt: Attempt) -> object:
        calls, kind = attempt.calls, attempt.kind
        identities = [call.slot.binding.identity for call in calls]
        if kind is ReadHolder:
            self._counts.campaign_reads += len(identities)
            return await self.coordinator.current_holders(identities)
        binding = calls[0].slot.binding  # a write batch shares these (turn.batches)
        if kind is AcquireDue:
            self._counts.acquires += len(identities)
            return await self.coordinator.acquire_many(identities, binding.connector_id,
                                                       scopes=binding.scopes,
                                                       ttl=binding.timing.ttl,
                                                       metadata=binding.metadata)
        takeovers = [call for call in calls if isinstance(call, TakeoverDue)]
        self._counts.takeovers += len(takeovers)
        return await self.coordinator.takeover_many(
            [(call.slot.binding.identity, call.expected_epoch) for call in takeovers],
            binding.connector_id, scopes=binding.scopes, ttl=binding.timing.ttl,
            observed=[call.observed for call in takeovers], metadata=binding.metadata)

    async def issue_grant(self, identity: LeaseIdentity, *, scopes: object,
                          ttl: float | timedelta, correlation_id: str | None = None
                          ) -> GrantResult:
        """Mint a grant for the lease held for ``identity``, or refuse locally when none is
        held; the local deadline is judged before and after the store call, as a keeper's
        ``issue_grant`` does. Store errors are raised, as the coordinator raises them."""
        drive = Drive(issue_grant(self._core, identity, scopes, ttl, correlation_id))
        for call in drive:
            drive.send(await outcome_of_async(self._grant, call))
        return drive.result

    async def _grant(self, call: IssueGrantCall) -> GrantResult:
        return await self.coordinator.issue_grant(call.lease, scopes=call.scopes, ttl=call.ttl,
                                                  correlation_id=call.correlation_id)

    async def handover(self, identity: LeaseIdentity, *, to: str,
                       drain: float | timedelta = DRAIN) -> HandoverResult:
        """Hand ``identity``'s lease to ``to``, a connector id (a supervisor or
        :func:`~mos_lease.hold` running the binding as that connector takes it over) or the
        member of this supervisor's fleet the placement prefers for it: the agent keeps its
        identity, the connector changes.

        The policy is asked first, as for ``to``'s takeover of the released lease, with the
        binding's scopes and ttl: a refusal is the result's ``reason``, and nothing is
        written. Then no new grant is minted on the lease (:meth:`lease` answers ``None``);
        the grants minted for it through :meth:`issue_grant` are given until they expire,
        at most ``drain`` seconds (0 to 30), while it is still renewed; it is released with
        the correlation id ``handover:<to>`` in its audit row and reported as
        :class:`~mos_lease.keep.changes.Moved`. The successor takes it over at the
        observed epoch as the release notice arrives (without notices, at its next look);
        this supervisor campaigns for it again only after the grace period (the fleet's, or
        5 s outside a fleet), so a successor that never comes leaves it unheld no longer
        than that. The result is a ``HandoverResult``
        (``mos_lease.keep.handover``); ``docs/fleet.md`` shows the whole step.

        An identity not run or not held here, a ``to`` that is empty, too long or the
        current holder, and a ``drain`` out of range raise
        :class:`~mos_lease.errors.InvalidInput` before anything is written or marked; a
        store error of the release is raised (the lease is then still held)."""
        drive = Drive(handover(self._core, identity, to, drain,
                               self.coordinator._flows.verdict), ())
        for call in drive:
            drive.send(await self._hand(call))
        return drive.result

    async def _hand(self, call: Sleep | FleetCall) -> object:
        if isinstance(call, Sleep):
            # The caller's own pause: the loop's wait (ended by its wake-ups) is the loop's;
            # turned by hand, the injected one.
            pause = asyncio.sleep if self._background else self._sleep
            return await pause(call.seconds)
        try:
            return await call.run(self.coordinator)
        except Exception as error:
            return error

    async def remove(self, identity: LeaseIdentity, *, release: bool = True
                     ) -> LeaseResult | None:
        """Stop running ``identity`` and release its lease if held and ``release`` (the
        release result, or ``None``); reports the loss with cause ``STOPPED``. While the
        supervisor closes, nothing: ``close()`` releases the lease and reports it."""
        lease = self._take(identity)
        if lease is None or not release:
            return None
        self._counts.releases += 1
        return await self.coordinator.release(lease)

    async def close(self, *, timeout: float | None = 10.0) -> None:
        """Stop the task (waiting at most ``timeout`` seconds for it to end) and release
        every held lease, one ``release_many`` round trip per 1,000, each reported lost
        (``STOPPED``) once its release is written. A release that fails is logged; the lease
        then expires at its ttl."""
        with self._core.lock:
            self._core.closing = True
        self._wakeup.set()
        await self._worker.stop(timeout)
        for batch in self._to_release():
            self._counts.releases += len(batch)
            try:
                outcome: list[LeaseResult] | Exception = await self.coordinator.release_many(
                    batch)
            except Exception as error:
                outcome = error
            self._released(batch, outcome)
        self._closed()

    def changes(self) -> AsyncIterator[Change]:
        """Every change from this call on, as it happens, to be read with ``async for``;
        the iteration ends when the supervisor closes. Changes wait in an unbounded queue
        until read: keep reading."""
        box: asyncio.Queue[Change | None] = asyncio.Queue()
        with self._core.lock:
            closed = self._core.closing
            self._core.listeners.append(box.put_nowait)
        return self._read(box, closed)

    async def _read(self, box: asyncio.Queue[Change | None], closed: bool
                    ) -> AsyncIterator[Change]:
        try:
            while not closed:
                change = await box.get()
                if change is None:
                    return
                yield change
        finally:
            with self._core.lock:
                self._core.listeners.remove(box.put_nowait)

    async def __aenter__(self) -> AsyncSupervisor:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()


# --- generated by tools/async_to_sync.py from the class above: do not edit ---


class Supervisor(_Supervisor[ConnectorLeaseCoordinator]):
    """Runs many bindings for a coordinator (:class:`~mos_lease.ConnectorLeaseCoordinator`)
    on one thread.

    Typical use::

        with Supervisor(coordinator, on_change=print) as supervisor:
            supervisor.add(identity, "gateway-a", scopes=["tool:run"], ttl=30)
            ...
            lease = supervisor.lease(identity)  # the handle to mint grants with, or None

    Every held lease is renewed by one ``heartbeat_many`` round trip per 1,000 leases per
    tick, each judged on its own with the keeper's deadline rule, two batches in flight at
    once. Each store call is given a time limit
    (:class:`~mos_lease.keep.calls.Calls`): one hanging past the earliest
    local deadline is abandoned and that deadline still reported.
    The supervisor's thread is started by the first :meth:`add`.
    ``on_change`` is called with each :data:`~mos_lease.supervisor.Change`, from the
    supervisor's thread (or from the thread whose call found it). With ``background=False``
    nothing is started and :meth:`turn` drives the supervisor by hand; ``clock`` (default:
    the coordinator's ``monotonic``), ``sleep`` and ``random`` are injectable.

    ``notices``: one push source of lease changes for every binding (a
    ``mos_lease_pg.notices.LeaseNotices``; :class:`~mos_lease.keep.notices.NoticeFeed`).
    A notice for a binding is a hint: it asks the source's notice confirmer for a turn
    (coalesced per identity, rate-bounded for the process) in which the supervisor reads the
    holder; a takeover it confirms is reported as the binding's loss at once, and the
    campaign goes on from what was read. ``docs/keeping.md`` explains the campaign and
    counts the threads and tasks each supervisor runs.

    ``heartbeat_coordinator``: renew through this coordinator (a connection of its own),
    as a keeper does, or through these two, batch by batch in turn, so that the two
    batches in flight run at once on two connections. ``on_event``: the telemetry hook
    (:mod:`mos_lease.events`), sent a :class:`~mos_lease.events.Renewed` or
    :class:`~mos_lease.events.RenewalRetry` per lease of each renewal and a
    :class:`~mos_lease.events.Lost` per loss, as a keeper's is.
    """

    _kind = ConnectorLeaseCoordinator
    # Renewal batches of a tick in flight at once (turn.IN_FLIGHT); the stateful
    # specification also runs it with one.
    _in_flight = IN_FLIGHT

    def __init__(self, coordinator: ConnectorLeaseCoordinator, *,
                 on_change: Callable[[Change], object] | None = None,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], object] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True, notices: NoticeFeed | None = None,
                 heartbeat_coordinator: ConnectorLeaseCoordinator
                 | Sequence[ConnectorLeaseCoordinator] | None = None,
                 on_event: EventHook | None = None, fleet: Fleet | None = None) -> None:
        self._wakeup = Wakeup()  # before the notice listener, which may wake it at once
        super().__init__(coordinator, on_change=on_change, clock=clock, random=random,
                         background=background, notices=notices,
                         heartbeat_coordinator=heartbeat_coordinator, on_event=on_event,
                         fleet=fleet)
        self._sleep = sleep if sleep is not None else self._wakeup.wait
        self._calls = Calls(self._core.clock, self.renewers, self._counts)
        self._worker = Worker()

    def _started(self) -> None:
        self._wakeup.set()
        if self._background:
            self._worker.start(self._run, self._name)

    def _real_sleep(self) -> Callable[[float], object]:
        return self._wakeup.wait

    def _wake_from_thread(self) -> bool:
        return self._wakeup.set_from_thread()

    def _run(self) -> None:
        while not self._core.closing:
            self._wakeup.clear()  # before the turn reads the schedule: no add is missed
            try:
                self.turn()
            except Exception as error:
                turn_failed(self._core, error)
                self._sleep(0.1)

    def turn(self) -> None:
        """One turn: renew what is due, make the campaign calls due, or sleep."""
        try:
            drive = Drive(turn(self._core, self._in_flight, len(self.renewers)), ())
            for call in drive:
                drive.send(self._perform(call))
        finally:
            # A turn collects every batch it started; one cut short (cancelled, or a bug
            # part-way: turn_failed) leaves its batches behind, never to start or be
            # waited for.
            self._calls.clear()

    def _perform(self, call: Call) -> object:
        if isinstance(call, Sleep):
            return self._sleep(call.seconds)
        if isinstance(call, RenewalBatch):  # started now, waited for by its Collect
            self._counts.renewal(len(call.leases))
            return self._calls.renew(self._next_renewer(self._calls.stuck), call)
        if isinstance(call, Collect):
            return self._calls.collect(call.ticket, call.timeout, call.patience)
        if isinstance(call, Attempt):
            return self._calls.bounded(self._campaign, call, call.timeout,
                                       self._unanswered)
        if isinstance(call, FleetCall):
            return self._calls.bounded(self._fleet, call, call.timeout)
        assert isinstance(call, ReleaseWon)
        self._counts.releases += 1
        try:
            return self.coordinator.release(call.lease)
        except Exception as error:
            return error

    def _unanswered(self, answer: object) -> None:
        """A campaign call's answer that came after its turn stopped waiting for it (the
        turn was cancelled, or the call ran past its limit): the schedule never saw it, so
        every lease it won is released here, whether or not its binding is still run."""
        for lease in won(answer):
            self._counts.releases += 1
            try:
                released: LeaseResult | Exception = self.coordinator.release(lease)
            except Exception as error:
                released = error
            unanswered_released(lease, released)

    def _fleet(self, call: FleetCall) -> object:
        return call.run(self.coordinator)

    def _campaign(self, attempt: Attempt) -> object:
        calls, kind = attempt.calls, attempt.kind
        identities = [call.slot.binding.identity for call in calls]
        if kind is ReadHolder:
            self._counts.campaign_reads += len(identities)
            return self.coordinator.current_holders(identities)
        binding = calls[0].slot.binding  # a write batch shares these (turn.batches)
        if kind is AcquireDue:
            self._counts.acquires += len(identities)
            return self.coordinator.acquire_many(identities, binding.connector_id,
                                                 scopes=binding.scopes,
                                                 ttl=binding.timing.ttl,
                                                 metadata=binding.metadata)
        takeovers = [call for call in calls if isinstance(call, TakeoverDue)]
        self._counts.takeovers += len(takeovers)
        return self.coordinator.takeover_many(
            [(call.slot.binding.identity, call.expected_epoch) for call in takeovers],
            binding.connector_id, scopes=binding.scopes, ttl=binding.timing.ttl,
            observed=[call.observed for call in takeovers], metadata=binding.metadata)

    def issue_grant(self, identity: LeaseIdentity, *, scopes: object,
                    ttl: float | timedelta, correlation_id: str | None = None
                    ) -> GrantResult:
        """Mint a grant for the lease held for ``identity``, or refuse locally when none is
        held; the local deadline is judged before and after the store call, as a keeper's
        ``issue_grant`` does. Store errors are raised, as the coordinator raises them."""
        drive = Drive(issue_grant(self._core, identity, scopes, ttl, correlation_id))
        for call in drive:
            drive.send(outcome_of(self._grant, call))
        return drive.result

    def _grant(self, call: IssueGrantCall) -> GrantResult:
        return self.coordinator.issue_grant(call.lease, scopes=call.scopes, ttl=call.ttl,
                                            correlation_id=call.correlation_id)

    def handover(self, identity: LeaseIdentity, *, to: str,
                 drain: float | timedelta = DRAIN) -> HandoverResult:
        """Hand ``identity``'s lease to ``to``, a connector id (a supervisor or
        :func:`~mos_lease.hold` running the binding as that connector takes it over) or the
        member of this supervisor's fleet the placement prefers for it: the agent keeps its
        identity, the connector changes.

        The policy is asked first, as for ``to``'s takeover of the released lease, with the
        binding's scopes and ttl: a refusal is the result's ``reason``, and nothing is
        written. Then no new grant is minted on the lease (:meth:`lease` answers ``None``);
        the grants minted for it through :meth:`issue_grant` are given until they expire,
        at most ``drain`` seconds (0 to 30), while it is still renewed; it is released with
        the correlation id ``handover:<to>`` in its audit row and reported as
        :class:`~mos_lease.keep.changes.Moved`. The successor takes it over at the
        observed epoch as the release notice arrives (without notices, at its next look);
        this supervisor campaigns for it again only after the grace period (the fleet's, or
        5 s outside a fleet), so a successor that never comes leaves it unheld no longer
        than that. The result is a ``HandoverResult``
        (``mos_lease.keep.handover``); ``docs/fleet.md`` shows the whole step.

        An identity not run or not held here, a ``to`` that is empty, too long or the
        current holder, and a ``drain`` out of range raise
        :class:`~mos_lease.errors.InvalidInput` before anything is written or marked; a
        store error of the release is raised (the lease is then still held)."""
        drive = Drive(handover(self._core, identity, to, drain,
                               self.coordinator._flows.verdict), ())
        for call in drive:
            drive.send(self._hand(call))
        return drive.result

    def _hand(self, call: Sleep | FleetCall) -> object:
        if isinstance(call, Sleep):
            # The caller's own pause: the loop's wait (ended by its wake-ups) is the loop's;
            # turned by hand, the injected one.
            pause = time.sleep if self._background else self._sleep
            return pause(call.seconds)
        try:
            return call.run(self.coordinator)
        except Exception as error:
            return error

    def remove(self, identity: LeaseIdentity, *, release: bool = True
               ) -> LeaseResult | None:
        """Stop running ``identity`` and release its lease if held and ``release`` (the
        release result, or ``None``); reports the loss with cause ``STOPPED``. While the
        supervisor closes, nothing: ``close()`` releases the lease and reports it."""
        lease = self._take(identity)
        if lease is None or not release:
            return None
        self._counts.releases += 1
        return self.coordinator.release(lease)

    def close(self, *, timeout: float | None = 10.0) -> None:
        """Stop the thread (waiting at most ``timeout`` seconds for it to end) and release
        every held lease, one ``release_many`` round trip per 1,000, each reported lost
        (``STOPPED``) once its release is written. A release that fails is logged; the lease
        then expires at its ttl."""
        with self._core.lock:
            self._core.closing = True
        self._wakeup.set()
        self._worker.stop(timeout)
        for batch in self._to_release():
            self._counts.releases += len(batch)
            try:
                outcome: list[LeaseResult] | Exception = self.coordinator.release_many(
                    batch)
            except Exception as error:
                outcome = error
            self._released(batch, outcome)
        self._closed()

    def changes(self) -> Iterator[Change]:
        """Every change from this call on, as it happens, to be read with ``for``;
        the iteration ends when the supervisor closes. Changes wait in an unbounded queue
        until read: keep reading."""
        box: queue.SimpleQueue[Change | None] = queue.SimpleQueue()
        with self._core.lock:
            closed = self._core.closing
            self._core.listeners.append(box.put_nowait)
        return self._read(box, closed)

    def _read(self, box: queue.SimpleQueue[Change | None], closed: bool
              ) -> Iterator[Change]:
        try:
            while not closed:
                change = box.get()
                if change is None:
                    return
                yield change
        finally:
            with self._core.lock:
                self._core.listeners.remove(box.put_nowait)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
