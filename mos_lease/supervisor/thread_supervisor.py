"""The thread supervisor: :class:`Supervisor` runs the turns of ``flow.py`` on one thread and
performs the calls they yield, each store call on a short-lived thread of its own so that
one hanging past the earliest local deadline is abandoned (:func:`mos_lease.bounded.bounded`;
a renewal is started and waited for apart, :func:`mos_lease.bounded.start`, as the turn
asks: this driver keeps two in flight, the next one primed on its own thread while the
last one's store call runs, see :class:`_Renewals`).
"""

from __future__ import annotations

import collections
import logging
import queue
import random as _random
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

from mos_lease.bounded import Running, bounded, start
from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.events import EventHook
from mos_lease.flowdrive import Drive, outcome_of
from mos_lease.identity import LeaseIdentity
from mos_lease.results import GrantResult, LeaseResult
from mos_lease.supervisor.base import _Supervisor
from mos_lease.supervisor.changes import Change
from mos_lease.supervisor.flow import (
    IN_FLIGHT,
    Attempt,
    Call,
    Collect,
    IssueGrantCall,
    Release,
    Sleep,
    issue_grant,
    turn,
    turn_failed,
)
from mos_lease.supervisor.notices import NoticeFeed
from mos_lease.supervisor.slots import Acquire, ReadHolder, Renew, Takeover

log = logging.getLogger("mos_lease.supervisor")


class Supervisor(_Supervisor[ConnectorLeaseCoordinator]):
    """Runs many bindings for a :class:`~mos_lease.ConnectorLeaseCoordinator` on one thread.

    Typical use::

        with Supervisor(coordinator, on_change=print) as supervisor:
            supervisor.add(identity, "gateway-a", scopes=["tool:run"], ttl=30)
            ...
            lease = supervisor.lease(identity)  # the handle to mint grants with, or None

    Every held lease is renewed by one ``heartbeat_many`` round trip per 1,000 leases per
    tick, each judged on its own with the keeper's deadline rule. A call runs on a
    short-lived daemon thread so that one hanging past the earliest local deadline is
    abandoned and that deadline still reported; at most two threads run at once (three with
    the PostgreSQL store's watchdog). Two renewal batches are in flight, as in the asyncio
    supervisor, without a thread more: the next batch is checked and built on the
    supervisor's thread while the last one's statement runs on the renewal thread.
    ``on_change`` is called with each :data:`~mos_lease.supervisor.Change`, from the
    supervisor thread (or from the thread whose call found it). With ``background=False``
    no thread is started and :meth:`turn` drives the supervisor by hand; ``clock``
    (default: the coordinator's ``monotonic``), ``sleep`` and ``random`` are injectable.

    ``notices``: one push source of lease changes for every binding (a
    ``mos_lease_pg.notices.LeaseNotices``; :class:`~mos_lease.supervisor.notices.NoticeFeed`).
    A notice for a binding is a hint: it asks the source's notice confirmer for a turn
    (coalesced per identity, rate-bounded for the process) in which the supervisor reads the
    holder; a takeover it confirms is reported as the binding's loss at once, and the
    campaign goes on from what was read (``docs/supervisor.md``).

    ``heartbeat_coordinator``: renew through this coordinator (a connection of its own),
    as a keeper does. ``on_event``: the telemetry hook (:mod:`mos_lease.events`), sent a
    :class:`~mos_lease.events.Renewed` or :class:`~mos_lease.events.RenewalRetry` per lease
    of each renewal and a :class:`~mos_lease.events.Lost` per loss, as a keeper's is.
    """

    _kind = ConnectorLeaseCoordinator
    # Renewal batches of a tick in flight at once (flow.IN_FLIGHT); the stateful
    # specification also runs it with one.
    _in_flight = IN_FLIGHT

    def __init__(self, coordinator: ConnectorLeaseCoordinator, *,
                 on_change: Callable[[Change], object] | None = None,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], object] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True, notices: NoticeFeed | None = None,
                 heartbeat_coordinator: ConnectorLeaseCoordinator | None = None,
                 on_event: EventHook | None = None) -> None:
        self._wakeup = threading.Event()
        super().__init__(coordinator, on_change=on_change, clock=clock, random=random,
                         background=background, notices=notices,
                         heartbeat_coordinator=heartbeat_coordinator, on_event=on_event)
        self._sleep = sleep if sleep is not None else self._wakeup.wait
        self._thread: threading.Thread | None = None
        self._renewals = _Renewals()

    def _started(self) -> None:
        self._wakeup.set()
        if self._background and self._thread is None:
            with self._core.lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name=self._name)
                    self._thread.start()

    def _real_sleep(self) -> Callable[[float], object]:
        return self._wakeup.wait

    def _wake_from_thread(self) -> bool:
        self._wakeup.set()
        return True

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
        # A turn collects every batch it started; one that raised part-way (turn_failed)
        # left its batches behind, and they are not started now, nor waited for.
        self._renewals.clear()
        drive = Drive(turn(self._core, self._in_flight), ())
        for call in drive:
            drive.send(self._perform(call))

    def _perform(self, call: Call) -> object:
        if isinstance(call, Sleep):
            return self._sleep(min(call.seconds, threading.TIMEOUT_MAX))
        if isinstance(call, Renew):
            self._counts.renewal(len(call.leases))
            return self._renewals.prime(self.renewer, call)
        if isinstance(call, Collect):
            assert isinstance(call.ticket, _Batch)
            return self._renewals.collect(call.ticket, call.timeout)
        if isinstance(call, Attempt):
            return bounded(lambda: self._campaign(call), call.timeout,
                           name="mos-lease-supervisor-campaign")
        assert isinstance(call, Release)
        self._counts.releases += 1
        try:
            return self.coordinator.release(call.lease)
        except Exception as error:
            return error

    def _campaign(self, attempt: Attempt) -> object:
        calls, kind = attempt.calls, attempt.kind
        identities = [call.slot.binding.identity for call in calls]
        if kind is ReadHolder:
            self._counts.campaign_reads += len(identities)
            return self.coordinator.current_holders(identities)
        binding = calls[0].slot.binding  # a write batch shares these (flow.batches)
        if kind is Acquire:
            self._counts.acquires += len(identities)
            return self.coordinator.acquire_many(identities, binding.connector_id,
                                                 scopes=binding.scopes,
                                                 ttl=binding.timing.ttl,
                                                 metadata=binding.metadata)
        takeovers = [call for call in calls if isinstance(call, Takeover)]
        self._counts.takeovers += len(takeovers)
        return self.coordinator.takeover_many(
            [(call.slot.binding.identity, call.expected_epoch) for call in takeovers],
            binding.connector_id, scopes=binding.scopes, ttl=binding.timing.ttl,
            observed=[call.observed for call in takeovers], metadata=binding.metadata)

    def issue_grant(self, identity: LeaseIdentity, *, scopes: object, ttl: float | timedelta,
                    correlation_id: str | None = None) -> GrantResult:
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

    def remove(self, identity: LeaseIdentity, *, release: bool = True
               ) -> LeaseResult | None:
        """Stop running ``identity`` and release its lease if held and ``release`` (the
        release result, or ``None``); reports the loss with cause ``STOPPED``."""
        lease = self._take(identity)
        if lease is None or not release:
            return None
        self._counts.releases += 1
        return self.coordinator.release(lease)

    def close(self, *, timeout: float | None = 10.0) -> None:
        """Stop the thread and release every held lease, one ``release_many`` round trip
        per 1,000, each reported lost (``STOPPED``) once its release is written. A release
        that fails is logged; the lease then expires at its ttl."""
        with self._core.lock:
            self._core.closing = True
        self._wakeup.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        for batch in self._close_all():
            self._counts.releases += len(batch)
            try:
                outcome: list[LeaseResult] | Exception = self.coordinator.release_many(
                    [lease for lease, _ in batch])
            except Exception as error:
                outcome = error
            self._released(batch, outcome)
        self._closed()

    def changes(self) -> Iterator[Change]:
        """Every change from this call on, as it happens; the iteration ends when the
        supervisor closes. Changes wait in an unbounded queue until read: keep reading."""
        box: queue.SimpleQueue[Change | None] = queue.SimpleQueue()
        with self._core.lock:
            closed = self._core.closing
            self._core.listeners.append(box.put)
        return self._read(box, closed)

    def _read(self, box: queue.SimpleQueue[Change | None], closed: bool) -> Iterator[Change]:
        try:
            while not closed:
                change = box.get()
                if change is None:
                    return
                yield change
        finally:
            with self._core.lock:
                self._core.listeners.remove(box.put)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class _Batch:
    """A renewal batch primed on the supervisor's thread (its leases checked, its statement
    built), whose store call and judging run on a thread of their own once started."""

    __slots__ = ("outcome", "rest", "running")

    def __init__(self, rest: Callable[[], list[LeaseResult]] | None,
                 outcome: object = None) -> None:
        self.rest = rest  # None: answered already (priming raised ``outcome``)
        self.outcome = outcome
        self.running: Running[list[LeaseResult]] | None = None


class _Renewals:
    """The renewal batches of the thread supervisor: each is primed when the turn asks for
    it, and its store call starts only when the one before it was collected, so one renewal
    thread runs at a time however many batches the turn keeps in flight. With two in
    flight, the next batch is primed (and the last one judged) on the supervisor's thread
    while a statement runs: the client's work overlaps the database's, and the library
    still runs three threads (the supervisor's, one renewal, the PostgreSQL store's
    watchdog)."""

    __slots__ = ("_queued", "_started")

    def __init__(self) -> None:
        self._queued: collections.deque[_Batch] = collections.deque()
        self._started: _Batch | None = None  # the batch whose thread may still run

    def clear(self) -> None:
        """Forget the batches of a turn that ended without collecting them: a queued one is
        never started, a started one is abandoned (as at its limit)."""
        self._queued.clear()
        self._started = None

    def prime(self, coordinator: ConnectorLeaseCoordinator, renew: Renew) -> _Batch:
        try:
            batch = _Batch(coordinator.prime_heartbeat_many(renew.leases, ttl=renew.ttl))
        except Exception as error:  # bad input: the batch's outcome, as its call's would be
            return _Batch(None, error)
        if self._started is None:
            self._start(batch)
        else:
            self._queued.append(batch)
        return batch

    def collect(self, batch: _Batch, timeout: float) -> object:
        """The batch's results, the exception its call raised, or ``OVERDUE`` (abandoned)
        after ``timeout`` seconds; the next batch's call starts as soon as this one ends."""
        if batch.rest is None:
            return batch.outcome
        while batch.running is None:  # queued behind batches collected before it
            self._start(self._queued.popleft())
        assert batch.running is not None
        outcome = batch.running.wait(timeout)
        if self._started is batch:
            self._started = None
            if self._queued:
                self._start(self._queued.popleft())
        return outcome

    def _start(self, batch: _Batch) -> None:
        assert batch.rest is not None
        batch.running = start(batch.rest, name="mos-lease-supervisor-renewal")
        self._started = batch
