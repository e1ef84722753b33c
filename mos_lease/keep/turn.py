"""The supervisor's turn, written once: what the thread and the asyncio supervisor do.

:func:`turn` is a generator that yields the calls it needs (:class:`~.slots.RenewalBatch`,
:class:`Collect`, :class:`Attempt`, :class:`ReleaseWon`, :class:`Sleep`) and is sent their
outcomes, as the keeper's flows are; the supervisors of ``runner.py`` perform them on one
thread or one task. An outcome is the call's result, the exception it raised (as a value:
store failures are judged by the schedule, not raised), or :data:`OVERDUE` for a call still
running at its time limit.

A renewal is the one call that is started and waited for apart: a
:class:`~.slots.RenewalBatch` is answered at once with a ticket, which a later
:class:`Collect` waits for. A driver may keep more than one batch of a tick in flight
(both supervisors keep :data:`IN_FLIGHT`), so that the client's work on one batch (its
renewals built, its results read) overlaps the database's work on the other.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, Final

import attrs

from mos_lease.bounded import OVERDUE
from mos_lease.errors import StoreUnavailable
from mos_lease.events import Emitter
from mos_lease.keep import fleet
from mos_lease.keep.changes import Change
from mos_lease.keep.schedule import BATCH, Schedule
from mos_lease.keep.slots import (
    AcquireDue,
    Campaign,
    Confirm,
    Due,
    ReadHolder,
    RenewalBatch,
    Slot,
    TakeoverDue,
)
from mos_lease.records import LeaseHandle
from mos_lease.results import LeaseResult
from mos_lease.sleep import Sleep

__all__ = ["IN_FLIGHT", "OVERDUE", "Attempt", "Call", "Collect", "Core", "Ended", "ReleaseWon",
           "Sleep", "batches", "turn", "turn_failed", "unanswered_released", "won"]

log = logging.getLogger("mos_lease.supervisor")

MAX_CALL: Final = 30.0
"""Seconds a campaign call may run while no lease is held (with leases held, a call may run
until the earliest local deadline, never longer)."""

IN_FLIGHT: Final = 2
"""Renewal batches of one tick a supervisor keeps in flight at once. Two: while the database
runs one batch's statement, the client builds the next and reads the last one's results
(some 40% of a batch's time, all of it Python), instead of each waiting for the other. A
third would only queue behind them (a dedicated connection runs one statement at a time).
The thread supervisor builds the next batch on its own thread and runs one store call at a
time on one renewal thread, so two in flight cost it no thread (``docs/keeping.md``)."""


@attrs.frozen(slots=True, eq=False)
class Attempt:
    """Make the campaign calls (or confirming reads) ``calls`` as one batched store call;
    give up waiting after ``timeout`` seconds. The calls are of one kind (:func:`batches`):
    reads (``current_holders``), acquires (``acquire_many``) or takeovers
    (``takeover_many``, each at its own epoch with its own observed view), the writes of
    bindings that share connector, scopes, ttl and metadata. Answered with one outcome per
    call, in order, or with what the whole call raised, or :data:`OVERDUE`."""

    calls: tuple[Campaign | Confirm, ...]
    timeout: float

    @property
    def kind(self) -> type[ReadHolder] | type[AcquireDue] | type[TakeoverDue]:
        first = self.calls[0]
        return ReadHolder if isinstance(first, Confirm) else type(first)


@attrs.frozen(slots=True, eq=False)
class Collect:
    """Wait for the renewal started as ``ticket`` (the driver's answer to its
    :class:`~.slots.RenewalBatch`) for at most ``timeout`` seconds: its results or exception
    (maybe as :class:`Ended`), or :data:`OVERDUE` (it is then abandoned), already after
    ``patience`` if another coordinator has returned a batch started later (its own
    coordinator is what is slow: :meth:`~.lanes.Lanes.outpaced`)."""

    ticket: object
    timeout: float
    patience: float


@attrs.frozen(slots=True, eq=False)
class Ended:
    """A renewal's ``outcome`` and the time ``at`` its call returned (the supervisor's
    clock), as of which it is judged: collected after an earlier batch was given up on at
    the deadline, it would otherwise lose leases it renewed in time."""

    outcome: object
    at: float


@attrs.frozen(slots=True)
class ReleaseWon:
    """Release a lease won for a binding removed while the call that won it was in flight."""

    lease: LeaseHandle


Call = RenewalBatch | Collect | Attempt | ReleaseWon | Sleep | fleet.FleetCall
Flow = Generator[Call, Any, None]


class Core:
    """The schedule under a lock, the clock, and the reporting of changes.

    The schedule is touched only under ``lock`` (the thread supervisor's caller threads and
    its loop thread share it, and so does the notice confirmer's thread of either
    supervisor). Changes are reported after the lock is released, so a callback may call
    back into the supervisor. ``confirming`` holds, per slot, the ``done`` of the notice
    confirmer's turn whose read is planned or in flight (``notices.py``):
    called once that read is over, so one read per identity is in flight."""

    def __init__(self, clock: Callable[[], float], draw: Callable[[], float],
                 on_change: Callable[[Change], object] | None,
                 emit: Emitter | None = None) -> None:
        self.clock = clock
        self.schedule = Schedule(draw)
        self.emit = emit
        if emit is not None:
            self.schedule.telemetry = []
        self.lock = threading.RLock()
        self.on_change = on_change
        self.listeners: list[Callable[[Change | None], object]] = []
        self.confirming: dict[Slot, Callable[[], None]] = {}
        # The ``done`` of the confirmer's turn that moved waiting bindings' reads to now
        # (Schedule.look_now): called once the next turn made those reads, so that the
        # notices coming meanwhile are coalesced into it.
        self.looking: list[Callable[[], None]] = []
        self.closing = False

    def report(self, changes: list[Change]) -> None:
        """Report ``changes`` (and emit the telemetry the schedule kept since the last
        report); called after every decision, outside the lock."""
        if self.emit is not None:
            with self.lock:
                telemetry, self.schedule.telemetry = self.schedule.telemetry, []
            for event in telemetry or ():
                self.emit(event)
        for change in changes:
            if self.on_change is not None:
                try:
                    self.on_change(change)
                except Exception:
                    # The change is recorded already; a failing callback must not stop the
                    # supervisor or hide the change from the other listeners.
                    log.exception("mos_lease: supervisor on_change callback failed")
            for listener in list(self.listeners):
                listener(change)


def turn_failed(core: Core, error: Exception) -> None:
    """A turn raised (a bug: store failures are values): free every slot it had claimed, so
    the next turn judges their deadlines and calls for them again."""
    log.error("mos_lease: supervisor turn failed: %r", error)
    with core.lock:
        _unclaim(core, list(core.schedule.slots.values()))
        _unclaim(core, list(core.confirming), confirm=True)


def _unclaim(core: Core, slots: list[Slot], confirm: bool = False) -> None:
    """Calls planned but not made: their slots are free for the next turn (which plans
    confirming reads again: their confirmer turns are still running, so nothing else would)."""
    for slot in slots:
        core.schedule.free(slot, confirm=confirm)


def turn(core: Core, in_flight: int = 1, lanes: int = 1) -> Flow:
    """One turn: report losses found at their deadline, send the renewals due (one call per
    batch, up to ``in_flight`` at once, over ``lanes`` renewal coordinators), then the
    confirming reads and campaign calls due until a renewal or deadline needs the driver
    again; or sleep until something is due."""
    with core.lock:
        now = core.clock()
        due = core.schedule.due(now)
        members = fleet.reading(core)  # a fleet member's read of the member set is due
        looked, core.looking = core.looking, []  # the reads these turns asked for are due
    core.report(due.changes)
    if not due.renewals and not due.campaigns and not due.confirms and not members:
        _done(looked)
        # Nothing is due until then (the driver wakes earlier on add() or close()).
        yield Sleep(max(due.wake_at - now, 0.0))
        return
    try:
        if (yield from _renewals(core, due, max(in_flight, 1), lanes)):
            if members:
                yield from fleet.members(core, MAX_CALL)
            yield from _campaign(core, [*due.confirms, *due.campaigns])
    finally:
        _done(looked)


def _done(turns: list[Callable[[], None]]) -> None:
    for done in turns:
        done()


@attrs.frozen(slots=True, eq=False)
class _Flight:
    """A renewal batch in flight: batch ``index`` of the tick, started at ``started``,
    answered by ``ticket``, given up on at ``limit`` (or ``patience``: :class:`Collect`)."""

    index: int
    renew: RenewalBatch
    started: float
    ticket: object
    limit: float
    patience: float


def _renewals(core: Core, due: Due, in_flight: int, lanes: int) -> Generator[Call, Any, bool]:
    """The renewals of ``due``, one call per batch, up to ``in_flight`` at once;
    ``False`` if the supervisor closed meanwhile (the batches in flight are waited for and
    judged, the rest of ``due`` is given back)."""
    with core.lock:
        # Other threads only remove bindings or record losses, which never make a limit
        # earlier: these stay conservative while the tick runs.
        rest, pending = core.schedule.limits(due.renewals)
    flying: deque[_Flight] = deque()
    closed_at: int | None = None
    for k, renew in enumerate(due.renewals):
        if len(flying) == in_flight:
            rest = yield from _collect(core, flying.popleft(), rest)
        started = core.clock()
        with core.lock:
            closing = core.closing
        if closing:
            closed_at = k
            break
        # The earliest deadline of the leases outside the tick and of the batches from the
        # oldest in flight on (theirs are still the old). On two renewal coordinators, one
        # outpaced by the other is given up on at half the time left to that of this batch
        # and those behind (one connection, busy with the hung call, could do no better).
        limit = min(rest, *pending[flying[0].index if flying else k:])
        patience = limit if lanes == 1 else min(limit, (started + min(pending[k:])) / 2)
        ticket = yield attrs.evolve(renew, timeout=max(limit - started, 0.0))
        flying.append(_Flight(k, renew, started, ticket, limit, patience))
    while flying:
        rest = yield from _collect(core, flying.popleft(), rest)
    if closed_at is None:
        return True
    with core.lock:
        _unclaim(core, [s for later in due.renewals[closed_at:] for s in later.slots])
        _unclaim(core, [call.slot for call in due.campaigns])
        _unclaim(core, [call.slot for call in due.confirms], confirm=True)
    return False


def _collect(core: Core, flight: _Flight, rest: float) -> Generator[Call, Any, float]:
    """Wait for ``flight`` until its limit and judge each of its leases; ``rest`` with the
    deadlines of the leases it left to retry."""
    now = core.clock()
    outcome = yield Collect(flight.ticket, max(flight.limit - now, 0.0),
                            max(flight.patience - now, 0.0))
    finished = core.clock()
    if isinstance(outcome, Ended):  # judged as of when its call returned
        finished, outcome = min(outcome.at, finished), outcome.outcome
    with core.lock:
        # Given up on before its limit (its coordinator outpaced or failed): retried.
        changes = core.schedule.renewed(flight.renew, None if outcome is OVERDUE else outcome,
                                        flight.started, finished, min(flight.limit, finished))
        rest = min(rest, core.schedule.deadlines(flight.renew.slots))  # retries keep theirs
    core.report(changes)
    return rest


def batches(calls: list[Campaign | Confirm]) -> list[tuple[Campaign | Confirm, ...]]:
    """``calls`` grouped into the batched store calls that make them, at most :data:`BATCH`
    each: the reads first (confirming reads ahead of the campaign's), then the takeovers,
    then the acquires. A write batch is sent as one connector with one set of scopes, ttl and
    metadata, so the writes are grouped by those of their bindings."""
    reads: list[Campaign | Confirm] = [c for c in calls if isinstance(c, Confirm)]
    reads += [c for c in calls if isinstance(c, ReadHolder)]
    writes: dict[tuple[object, ...], list[Campaign | Confirm]] = {}
    for kind in (TakeoverDue, AcquireDue):
        for call in calls:
            if isinstance(call, kind):
                binding = call.slot.binding
                key = (kind, binding.connector_id, binding.scopes, binding.timing.ttl,
                       binding.metadata)
                writes.setdefault(key, []).append(call)
    groups = [reads, *writes.values()]
    return [tuple(group[first:first + BATCH]) for group in groups
            for first in range(0, len(group), BATCH)]


def _campaign(core: Core, calls: list[Campaign | Confirm]) -> Flow:
    """The confirming reads, then the campaign calls, in batches (:func:`batches`), until
    a renewal or deadline of a held lease is due: the confirming reads go first, as a loss
    they find is worth reporting at once. Each binding's outcome is judged on its own, as
    a single call's would be (:meth:`Schedule.campaigned`, :meth:`Schedule.confirmed`)."""
    with core.lock:
        # Read once, then moved earlier by each lease won below: nothing else makes a held
        # lease due sooner (other threads only remove bindings or record losses), and the
        # campaign of thousands of bindings must not rescan them all after every call.
        urgent_at, earliest = core.schedule.urgent_at(), core.schedule.earliest_deadline()
    planned = batches(calls)
    k = 0
    while k < len(planned):
        batch = planned[k]
        k += 1
        started = core.clock()
        with core.lock:
            if core.closing or started >= urgent_at:
                # Renewals first: the rest waits for the next turn.
                rest = [c for later in planned[k - 1:] for c in later]
                _unclaim(core, [c.slot for c in rest if isinstance(c, Confirm)], confirm=True)
                _unclaim(core, [c.slot for c in rest if not isinstance(c, Confirm)])
                return
        timeout = min(earliest - started, MAX_CALL)
        answer = yield Attempt(batch, max(timeout, 0.0))
        finished = core.clock()
        outcomes = _outcomes(batch, answer, timeout)
        orphans: list[LeaseHandle] = []
        for call, outcome in zip(batch, outcomes, strict=True):
            if isinstance(call, Confirm):
                _confirmed(core, call, outcome, finished)
                continue
            with core.lock:
                changes, orphan = core.schedule.campaigned(call, outcome, started, finished)
                won = call.slot.state if call.slot.holding else None
            if won is not None:
                urgent_at = min(urgent_at, won.renew_at, won.deadline)
                earliest = min(earliest, won.deadline)
            core.report(changes)
            if orphan is not None:
                orphans.append(orphan)
        read = [c.slot for c in batch if isinstance(c, ReadHolder)]
        if read:
            # The takeovers and acquires these reads decided are made next, before the
            # turn's other reads.
            with core.lock:
                writes = core.schedule.writes_due(read, finished)
            planned[k:k] = batches(list(writes))
        for orphan in orphans:
            released = yield ReleaseWon(orphan)
            if isinstance(released, BaseException):
                log.warning("mos_lease: could not release the lease of removed binding %s: "
                            "%r; it expires at its ttl", orphan.identity, released)


def won(answer: object) -> list[LeaseHandle]:
    """The leases a campaign call's ``answer`` won (a batched write's results; nothing for a
    read, an exception or :data:`OVERDUE`)."""
    if not isinstance(answer, list):
        return []
    return [result.lease for result in answer
            if isinstance(result, LeaseResult) and result.ok and result.lease is not None]


def unanswered_released(lease: LeaseHandle, released: LeaseResult | BaseException) -> None:
    """Log a release of a lease won by an unanswered campaign call that did not succeed (the
    lease then expires at its ttl)."""
    if isinstance(released, BaseException) or not released.ok:
        log.warning("mos_lease: could not release the lease of %s won by a campaign call "
                    "nobody waited for: %r; it expires at its ttl", lease.identity,
                    released if isinstance(released, BaseException) else released.reason)


def _outcomes(batch: tuple[Campaign | Confirm, ...], answer: Any, timeout: float
              ) -> list[Any]:
    """One outcome per call of ``batch`` from the batched call's ``answer``: its results,
    or what the whole call raised (or its being abandoned) given to each call."""
    if answer is OVERDUE:
        answer = StoreUnavailable(f"campaign call still running after {timeout:.3f} s; "
                                  "abandoned")
    elif isinstance(answer, BaseException):
        if not isinstance(answer, StoreUnavailable):
            log.error("mos_lease: campaign call for %d binding(s) (%s, ...) failed: %r",
                      len(batch), batch[0].slot.binding.identity, answer)
    elif not isinstance(answer, list) or len(answer) != len(batch):
        answer = StoreUnavailable(f"a batched campaign call answered "
                                  f"{len(answer) if isinstance(answer, list) else answer!r} "
                                  f"for {len(batch)} bindings")
    if isinstance(answer, BaseException):
        return [answer] * len(batch)
    return list(answer)


def _confirmed(core: Core, call: Confirm, outcome: Any, finished: float) -> None:
    """Judge a confirming read, report what it shows, and end the confirmer's turn."""
    with core.lock:
        changes = core.schedule.confirmed(call, outcome, finished)
        done = core.confirming.pop(call.slot, None)
    core.report(changes)
    if done is not None:
        done()  # the identity may be confirmed again (one read in flight per identity)
