"""The schedule's timelines answer exactly what a look at every slot would.

:class:`ScanSchedule` keeps, in this test only, the schedule as it was before the timelines:
``due()``, ``urgent_at()``, ``earliest_deadline()`` and ``limits()`` each scan every slot.
A Hypothesis state machine drives it and the indexed :class:`Schedule` in lockstep through
adds, removals (closing or not), turns, renewal and campaign outcomes of every kind (in any
order, late or never: calls given back), notices, looks, lease reads, revealed losses and
time passing, and checks after every step that both answered the same: the same changes,
renewal batches, campaign calls, confirming reads and wake-up time, in the same order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import uuid4

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mos_lease import LeaseHandle, LeaseIdentity, LeaseResult, Reason, StoreUnavailable
from mos_lease.keep.changes import Change
from mos_lease.keep.schedule import BATCH, Schedule, _held
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
from mos_lease.keeper import KeeperTiming, LeaseLoss, LossCause
from mos_lease.results import HolderView
from mos_lease.supervisor import Binding
from mos_lease.vocabulary import LeaseState, Outcome

START = datetime(2030, 1, 1, tzinfo=UTC)
SCOPES = ("tool:run",)
BINDINGS = 6


class ScanSchedule(Schedule):
    """The reference: the schedule's questions answered by looking at every slot."""

    def due(self, now: float) -> Due:
        changes: list[Change] = []
        campaigns: list[Campaign] = []
        confirms: list[Confirm] = []
        noticed: list[Slot] = []
        groups: dict[float, list[Slot]] = {}
        wake_at = math.inf
        renewing = False
        for slot in self.slots.values():
            if slot.busy:
                continue
            changes += self._judge(slot, now)
            state = slot.state
            if state is not None and state.loss is None:
                timing = slot.binding.timing
                early = self._coalesce * timing.ttl * timing.renew_fraction
                if now >= state.renew_at or (state.failures == 0
                                             and now >= state.renew_at - early):
                    groups.setdefault(timing.ttl, []).append(slot)
                    renewing |= now >= state.renew_at
                else:
                    wake_at = min(wake_at, state.renew_at)
                if slot.confirm:
                    noticed.append(slot)
            elif slot.confirm:
                confirms.append(Confirm(slot, None))
            elif now >= slot.try_at:
                campaigns.append(self._campaign(slot))
            else:
                wake_at = min(wake_at, slot.try_at)
        renewals: list[RenewalBatch] = []
        if renewing:
            for ttl, members in groups.items():
                for first in range(0, len(members), BATCH):
                    batch = tuple(members[first:first + BATCH])
                    for slot in batch:
                        slot.busy = True
                    renewals.append(RenewalBatch(batch, tuple(_held(s).lease for s in batch), ttl,
                                          math.inf, now))
        else:
            for members in groups.values():
                for slot in members:
                    wake_at = min(wake_at, _held(slot).renew_at)
        confirms += [Confirm(slot, _held(slot).lease) for slot in noticed if not slot.busy]
        for call in campaigns:
            call.slot.busy = True
        for confirm in confirms:
            confirm.slot.busy, confirm.slot.confirm = True, False
        return Due(changes, renewals, campaigns, wake_at, confirms)

    def earliest_deadline(self) -> float:
        return min((s.state.deadline for s in self.slots.values()
                    if s.state is not None and s.state.loss is None), default=math.inf)

    def limits(self, renewals: Sequence[RenewalBatch]) -> tuple[float, list[float]]:
        claimed = {id(slot) for renew in renewals for slot in renew.slots}
        rest = min((s.state.deadline for s in self.slots.values()
                    if id(s) not in claimed and s.state is not None and s.state.loss is None),
                   default=math.inf)
        return rest, [self.deadlines(renew.slots) for renew in renewals]

    def urgent_at(self) -> float:
        return min((min(s.state.renew_at, s.state.deadline) for s in self.slots.values()
                    if not s.busy and s.state is not None and s.state.loss is None),
                   default=math.inf)


def ident(n: int) -> LeaseIdentity:
    return LeaseIdentity("acme", f"agent-{n}", "b")


def draws() -> Callable[[], float]:
    """The same sequence of 'random' draws for each schedule: both draw in the same order
    as long as they decide the same."""
    values = itertools.cycle([0.13, 0.92, 0.5, 0.31, 0.77, 0.05, 0.64])
    return lambda: next(values)


def due_view(due: Due) -> tuple[Any, ...]:
    """What a driver acts on, with slots named by their identities."""
    return (
        due.changes,
        [([s.binding.identity for s in r.slots], r.leases, r.ttl, r.tick, r.timeout)
         for r in due.renewals],
        [(type(c).__name__, c.slot.binding.identity,
          c.expected_epoch if isinstance(c, TakeoverDue) else None,
          c.observed if isinstance(c, TakeoverDue) else None) for c in due.campaigns],
        [(c.slot.binding.identity, c.held) for c in due.confirms],
        due.wake_at,
    )


class TimelineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.indexed = Schedule(draws())
        self.scan = ScanSchedule(draws())
        self.now = 0.0
        # Calls in flight: (the indexed schedule's, the reference's, when it started).
        self.flying: list[tuple[Any, Any, float]] = []

    def both(self, ask: Callable[[Schedule], Any]) -> Any:
        mine, reference = ask(self.indexed), ask(self.scan)
        assert mine == reference
        return mine

    # -- registering ----------------------------------------------------------------------

    @rule(n=st.integers(0, BINDINGS - 1), ttl=st.sampled_from([10.0, 30.0]),
          noticed=st.booleans())
    def add(self, n: int, ttl: float, noticed: bool) -> None:
        if ident(n) in self.indexed.slots:
            return
        self.indexed.noticed = self.scan.noticed = noticed
        binding = Binding(ident(n), "gw-a", SCOPES, KeeperTiming(ttl))
        self.indexed.add(binding, self.now)
        self.scan.add(binding, self.now)

    @rule(n=st.integers(0, BINDINGS - 1), closing=st.booleans())
    def remove(self, n: int, closing: bool) -> None:
        if ident(n) not in self.indexed.slots:
            return
        self.both(lambda s: s.remove(ident(n), self.now, closing=closing))

    # -- turns and outcomes ---------------------------------------------------------------

    @rule(seconds=st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0]), st.floats(0, 8)))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @rule()
    def turn(self) -> None:
        mine, reference = self.indexed.due(self.now), self.scan.due(self.now)
        assert due_view(mine) == due_view(reference)
        for a, b in zip([*mine.renewals, *mine.campaigns, *mine.confirms],
                        [*reference.renewals, *reference.campaigns, *reference.confirms],
                        strict=True):
            self.flying.append((a, b, self.now))

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def call_returns(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(0, len(self.flying) - 1))
        mine, reference, started = self.flying.pop(k)
        finished = max(self.now, started) + data.draw(st.sampled_from([0.0, 0.2, 3.0]))
        if isinstance(mine, RenewalBatch):
            outcome: Any = renewal_outcome(data, mine)
        elif isinstance(mine, Confirm):
            outcome = read_outcome(data)
        else:
            outcome = campaign_outcome(data, mine)
        self.answer(mine, reference, outcome, started, finished)

    @precondition(lambda self: self.flying)
    @rule()
    def every_call_succeeds(self) -> None:
        """Every call in flight returns at once, as well as it can: the quick way to many
        held leases, whose renewals then come close together."""
        flying, self.flying = self.flying, []
        for mine, reference, started in flying:
            outcome: Any = None  # a confirming read or a first read: no lease
            if isinstance(mine, RenewalBatch):
                outcome = [LeaseResult(Outcome.RENEWED, None, "c", lease=lease)
                           for lease in mine.leases]
            elif isinstance(mine, AcquireDue | TakeoverDue):
                epoch = 1 if isinstance(mine, AcquireDue) else mine.expected_epoch + 1
                outcome = LeaseResult(Outcome.ACQUIRED, None, "c",
                                      lease=handle(mine.slot.binding.identity, epoch))
            self.answer(mine, reference, outcome, started, max(self.now, started))

    def answer(self, mine: Any, reference: Any, outcome: Any, started: float,
               finished: float) -> None:
        """Both schedules judge ``outcome`` of their call, and say the same."""
        answers: list[Any] = []
        for schedule, call in ((self.indexed, mine), (self.scan, reference)):
            if isinstance(call, RenewalBatch):
                answers.append(schedule.renewed(call, outcome, started, finished))
            elif isinstance(call, Confirm):
                answers.append(schedule.confirmed(call, outcome, finished))
            else:
                answers.append(schedule.campaigned(call, outcome, started, finished))
        assert answers[0] == answers[1]

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def call_given_back(self, data: st.DataObject) -> None:
        """A call planned but not made (the supervisor closed, or a renewal came first)."""
        k = data.draw(st.integers(0, len(self.flying) - 1))
        mine, reference, _ = self.flying.pop(k)
        for schedule, call in ((self.indexed, mine), (self.scan, reference)):
            slots = call.slots if isinstance(call, RenewalBatch) else (call.slot,)
            for slot in slots:
                schedule.free(slot, confirm=isinstance(call, Confirm))

    # -- notices and questions ------------------------------------------------------------

    @rule(n=st.integers(0, BINDINGS - 1))
    def notice(self, n: int) -> None:
        mine, reference = self.indexed.notice(ident(n)), self.scan.notice(ident(n))
        assert (mine is None) == (reference is None)

    @rule(n=st.integers(0, BINDINGS - 1))
    def look(self, n: int) -> None:
        self.both(lambda s: s.look(ident(n), self.now))

    @rule(n=st.integers(0, BINDINGS - 1))
    def lease(self, n: int) -> None:
        if ident(n) in self.indexed.slots or ident(n) in self.indexed.closed:
            self.both(lambda s: s.lease(ident(n), self.now))

    @rule(n=st.integers(0, BINDINGS - 1))
    def loss_revealed(self, n: int) -> None:
        slot = self.indexed.slots.get(ident(n))
        if slot is None or slot.state is None:
            return
        lease = slot.state.lease
        loss = LeaseLoss(LossCause.DENIED, Reason.LEASE_REPLACED, self.now)
        self.both(lambda s: s.reveal(ident(n), lease, loss))

    @precondition(lambda self: any(isinstance(a, RenewalBatch) for a, _, _ in self.flying))
    @rule(data=st.data())
    def loss_revealed_in_flight(self, data: st.DataObject) -> None:
        """A grant refused while the lease's renewal is in flight: the loss comes first."""
        renewals = [a for a, _, _ in self.flying if isinstance(a, RenewalBatch)]
        renew = data.draw(st.sampled_from(renewals))
        k = data.draw(st.integers(0, len(renew.slots) - 1))
        identity, lease = renew.slots[k].binding.identity, renew.leases[k]
        loss = LeaseLoss(LossCause.DENIED, Reason.LEASE_REPLACED, self.now)
        self.both(lambda s: s.reveal(identity, lease, loss))

    @invariant()
    def the_same_times(self) -> None:
        self.both(lambda s: s.earliest_deadline())
        self.both(lambda s: s.urgent_at())

    @invariant()
    def the_same_limits(self) -> None:
        mine = [a for a, _, _ in self.flying if isinstance(a, RenewalBatch)]
        reference = [b for _, b, _ in self.flying if isinstance(b, RenewalBatch)]
        assert self.indexed.limits(mine) == self.scan.limits(reference)

    @invariant()
    def the_same_slots(self) -> None:
        def view(schedule: Schedule) -> list[tuple[Any, ...]]:
            return [(i, s.state, s.step, s.try_at, s.busy, s.confirm, s.failures)
                    for i, s in schedule.slots.items()]
        self.both(view)


def handle(identity: LeaseIdentity, epoch: int) -> LeaseHandle:
    return LeaseHandle(identity, "gw-a", uuid4(), epoch, SCOPES, START)


def renewal_outcome(data: st.DataObject, call: RenewalBatch) -> Any:
    kind = data.draw(st.sampled_from(["each", "down", "bug", "abandoned", "short"]))
    if kind == "down":
        return StoreUnavailable("down")
    if kind == "bug":
        return RuntimeError("bug")
    if kind == "abandoned":
        return None
    if kind == "short":
        return []
    results = []
    for lease in call.leases:
        one = data.draw(st.sampled_from(["ok", "not reached", "denied"]))
        if one == "ok":
            results.append(LeaseResult(Outcome.RENEWED, None, "c", lease=lease))
        elif one == "not reached":
            results.append(LeaseResult(Outcome.DENIED, Reason.STORE_UNAVAILABLE, "c"))
        else:
            results.append(LeaseResult(Outcome.DENIED, Reason.LEASE_REPLACED, "c"))
    return results


def view_of(data: st.DataObject) -> HolderView | None:
    state = data.draw(st.sampled_from([None, *LeaseState]))
    if state is None:
        return None
    epoch = data.draw(st.integers(1, 4))
    return HolderView(data.draw(st.sampled_from(["gw-a", "gw-b"])), epoch, state,
                      START + timedelta(seconds=data.draw(st.sampled_from([-5, 5, 60]))),
                      START)


def read_outcome(data: st.DataObject) -> HolderView | BaseException | None:
    if data.draw(st.booleans()):
        return StoreUnavailable("down")
    return view_of(data)


def campaign_outcome(data: st.DataObject, call: Campaign) -> Any:
    kind = data.draw(st.sampled_from(["win", "refused", "refused, seen", "down"]))
    if kind == "down":
        return StoreUnavailable("down")
    if isinstance(call, ReadHolder):
        return view_of(data)
    if kind == "win":
        epoch = 1 if isinstance(call, AcquireDue) else call.expected_epoch + 1
        return LeaseResult(Outcome.ACQUIRED, None, "c",
                           lease=handle(call.slot.binding.identity, epoch))
    holder = view_of(data) if kind == "refused, seen" else None
    return LeaseResult(Outcome.DENIED, Reason.LEASE_HELD, "c", holder=holder)


TimelineMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=80,
                                             deadline=None)
test_the_timelines_answer_what_a_full_scan_would = TimelineMachine.TestCase


class Watched(dict[LeaseIdentity, Slot]):
    """The registry of slots, counting every look at all of it."""

    scans = 0

    def __iter__(self) -> Any:
        self.scans += 1
        return super().__iter__()

    def values(self) -> Any:
        self.scans += 1
        return super().values()

    def items(self) -> Any:
        self.scans += 1
        return super().items()


def test_a_turn_with_one_thing_due_looks_at_no_other_binding() -> None:
    """Of 2,000 held bindings, a notice asks for one confirming read: neither the turn that
    plans it nor the times a turn asks for look at the 1,999 others."""
    schedule = Schedule(lambda: 0.5)
    for n in range(2_000):
        schedule.add(Binding(ident(n), "gw-a", SCOPES, KeeperTiming(30.0)), 0.0)
    for call in schedule.due(0.0).campaigns:
        schedule.campaigned(call, None, 0.0, 0.0)  # never held: acquired next
    for call in schedule.due(0.0).campaigns:
        won = LeaseResult(Outcome.ACQUIRED, None, "c", lease=handle(call.slot.binding.identity, 1))
        schedule.campaigned(call, won, 0.0, 0.0)
    assert all(slot.holding for slot in schedule.slots.values())
    watched = schedule.slots = Watched(schedule.slots)
    schedule.notice(ident(7))
    due = schedule.due(1.0)
    assert [(c.slot.binding.identity, c.held is not None) for c in due.confirms] == [
        (ident(7), True)]
    assert not due.renewals and not due.campaigns and not due.changes
    assert due.wake_at == 10.0  # the first renewal (ttl / 3, no jitter at a draw of 0.5)
    assert schedule.urgent_at() == 10.0 and schedule.earliest_deadline() == 25.0
    assert schedule.limits([]) == (25.0, [])
    assert schedule.confirmed(due.confirms[0], None, 1.0) == []
    assert schedule.due(1.0).wake_at == 10.0
    assert watched.scans == 0
    # The renewal tick renews all 2,000 (what is due), in two batches.
    assert [len(r.slots) for r in schedule.due(10.0).renewals] == [1_000, 1_000]
