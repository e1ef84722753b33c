"""The supervisor's schedule: for every binding, what to do at monotonic time ``now``.

Pure: no clock is read, no store is called, no randomness is drawn that is not handed in.
:class:`Schedule` keeps one :class:`Slot` per registered binding. A held binding follows the
keeper's schedule (:mod:`mos_lease.keep.timing`: the same deadline, the same retry and
the same loss rule as :func:`~mos_lease.hold`); a binding without a lease campaigns, as
client-go's leader election does: read the holder, acquire an identity never held, take over
an expired or released lease at the observed epoch, back off with jitter (or, with notices,
wait out an active lease to its expiry), and campaign again after a loss.

:meth:`Schedule.due` returns the calls due at ``now``: renewals grouped by ttl into batches of
at most :data:`BATCH` leases (one ``heartbeat_many`` round trip each), and a campaign call per
binding, which the turn sends in batches (:func:`mos_lease.keep.turn.batches`). Each
call's outcome goes back, per binding, through :meth:`Schedule.renewed` or
:meth:`Schedule.campaigned`, which return the changes to report. The values it decides with
are in :mod:`~mos_lease.keep.slots` (the bindings, their slots and the calls) and
:mod:`~mos_lease.keep.changes` (what is reported).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Literal

from mos_lease import events
from mos_lease.checks import MAX_BATCH
from mos_lease.errors import InvalidInput, StoreUnavailable
from mos_lease.fleet.membership import Membership
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.campaign import ACQUIRE, RETRY_REASONS, next_try, pause_for
from mos_lease.keep.changes import (
    BindingLost,
    BindingStarted,
    Change,
    GaveUp,
    Moved,
    NewHolder,
)
from mos_lease.keep.slots import (
    AcquireDue,
    Binding,
    Campaign,
    Confirm,
    Due,
    ReadHolder,
    RenewalBatch,
    Slot,
    TakeoverDue,
)
from mos_lease.keep.timeline import Timeline
from mos_lease.keep.timing import (
    KeeperState,
    LeaseLoss,
    LossCause,
    ReportLoss,
    abandoned,
    after_renewal,
    held,
    lose,
    next_action,
)
from mos_lease.records import LeaseHandle
from mos_lease.results import HolderView, LeaseResult
from mos_lease.vocabulary import LeaseState, Reason

log = logging.getLogger("mos_lease.supervisor")

Look = Literal["moved", "soon", "no", "held"]
"""What :meth:`Schedule.look` made of a notice."""

BATCH: Final = MAX_BATCH
"""Leases renewed per ``heartbeat_many`` call: the most one call accepts (1,000)."""

COALESCE: Final = 0.5
"""A held lease joins a renewal batch that goes out up to this fraction of its renewal
interval (``ttl * renew_fraction``) before its own renewal is due. Renewing early is safe (the
deadline only moves later: it is counted from the start of the renewing call), and it is what
gathers the leases of a process into one tick instead of one round trip per lease."""


DRAIN: Final = 5.0
"""Seconds a hand-off waits at most for the grants minted for the lease to expire, before
its release: the default of ``handover(drain=...)``, and the bound of a fleet's hand-offs."""


# --- the schedule ----------------------------------------------------------------------------


class Schedule:
    """Every binding's state, and the decisions about all of them. Not thread-safe: a driver
    calls it from one thread at a time (under a lock) or from one event loop."""

    def __init__(self, draw: Callable[[], float], coalesce: float = COALESCE) -> None:
        self._draw = draw
        self._coalesce = coalesce
        # Whether notices tell of releases and takeovers (the supervisor has a source): an
        # active lease held elsewhere is then waited out to its expiry, not re-read at
        # every backoff (campaign.pause_for), and a notice is the reason to look
        # sooner (look()).
        self.noticed = False
        self.slots: dict[LeaseIdentity, Slot] = {}
        # The telemetry of the renewals judged and the losses recorded (mos_lease.events),
        # kept only when someone listens (on_event): the driver takes them after each
        # decision and emits them outside its lock.
        self.telemetry: list[events.Event] | None = None
        # The bindings dropped while the supervisor closed: asked about, they hold nothing
        # (a status request during shutdown sees None), unlike an identity never added.
        self.closed: set[LeaseIdentity] = set()
        # The bindings held once whose loss ended them, with that loss: asked about, they
        # hold nothing (and a grant is refused with that loss) until added again or removed.
        self.ended: dict[LeaseIdentity, LeaseLoss] = {}
        self._order = itertools.count()
        # The timelines a turn finds what is due on (mos_lease.keep.timeline), so that
        # it costs what is due in it, not the number of bindings: the held leases by local
        # deadline (busy ones too: a call in flight is bounded by them), the free held ones
        # by renewal and by the start of their coalescing window, the free campaigning ones
        # by their next try; and the slots a confirming read was asked for. Every change to
        # a slot's times goes through _index (its old entries go stale).
        self._deadlines = Timeline(_holding)
        self._renewals = Timeline(_free_holding)
        self._windows = Timeline(_free_holding)
        self._tries = Timeline(_free_campaigning)
        self._confirms: set[Slot] = set()
        # The fleet this supervisor is a member of (mos_lease.keep.fleet): its gate
        # judges every campaign read, and its member lease is one of the slots.
        self.fleet: Membership | None = None
        # The waiting slots a notice came for less than max_backoff after their last read:
        # read at once by look_now(), in a confirming turn of the notice confirmer.
        self._soon: set[Slot] = set()
        # The held slots the fleet hands over once their grants have expired (until when,
        # at the latest): no new grant on them meanwhile.
        self._draining: dict[Slot, float] = {}

    def __len__(self) -> int:
        return len(self.slots)

    # -- registering --------------------------------------------------------------------------

    def add(self, binding: Binding, now: float,
            start: tuple[LeaseHandle, float] | None = None) -> list[Change]:
        """Register ``binding``: it campaigns from ``now``, or, given ``start`` (a lease won
        by a call made elsewhere, and that call's start), holds that lease from then on:
        the change to report."""
        if binding.identity in self.slots:
            raise InvalidInput("identity", "is already supervised; remove it first")
        slot = self.slots[binding.identity] = Slot(binding, now, next(self._order))
        if self.fleet is not None:
            self.fleet.add(binding.identity)
        self.ended.pop(binding.identity, None)
        if start is None:
            self._index(slot)
            return []
        lease, started = start
        slot.state = held(binding.timing, lease, started, self._draw())
        slot.gives_up_at, slot.seen = None, (lease.connector_id, lease.epoch)
        self._index(slot)
        return [BindingStarted(binding.identity, lease)]

    def free(self, slot: Slot, *, confirm: bool = False) -> None:
        """A call planned for ``slot`` was not made: the slot is free for the next turn (and
        its confirming read, if ``confirm``, is planned again)."""
        slot.busy = False
        slot.confirm |= confirm
        self._index(slot)

    def remove(self, identity: LeaseIdentity, now: float, *, closing: bool = False
               ) -> tuple[LeaseHandle | None, list[Change]]:
        """Forget ``identity``: the held lease to release (if any) and the loss to report
        (cause ``STOPPED``). A call still in flight for it finds its slot removed.
        ``closing``: the supervisor is closing, and :meth:`lease` answers ``None`` for the
        identity from now on instead of refusing it as never added."""
        slot = self.slots.pop(identity, None)
        if slot is None:
            if self.ended.pop(identity, None) is not None:
                return None, []  # held once and lost: nothing left to release
            raise InvalidInput("identity", "is not supervised")
        if closing:
            self.closed.add(identity)
        if self.fleet is not None:
            self.fleet.remove(identity)
        slot.removed = True
        slot.version += 1  # off every timeline
        state = slot.state
        if state is None or state.loss is not None:
            return None, []
        slot.state = lose(state, LeaseLoss(LossCause.STOPPED, Reason.LEASE_RELEASED, now))
        return state.lease, [self._lost(slot)]

    def lease(self, identity: LeaseIdentity, now: float) -> tuple[LeaseHandle | None,
                                                                   list[Change]]:
        """The lease held for ``identity`` at ``now``, or ``None``; a deadline found passed is
        recorded (and returned as a change to report), as a keeper's ``enforce_deadline``.
        ``None`` for a binding dropped while the supervisor closed (:meth:`remove`)."""
        slot = self.slots.get(identity)
        if slot is None:
            if identity in self.closed or identity in self.ended:
                return None, []
            raise InvalidInput("identity", "is not supervised")
        changes = self._judge(slot, now)
        if slot.handing:  # being handed to another member: no new grant on it
            return None, changes
        return (slot.state.lease if slot.holding and slot.state is not None else None), changes

    def reveal(self, identity: LeaseIdentity, lease: LeaseHandle, loss: LeaseLoss
               ) -> list[Change]:
        """Record ``loss`` of ``lease`` learned elsewhere (a grant refused because the lease
        is gone), unless the binding holds another lease by now or lost it already."""
        slot = self.slots.get(identity)
        state = None if slot is None else slot.state
        if slot is None or state is None or state.loss is not None \
                or state.lease.lease_id != lease.lease_id:
            return []
        slot.state = lose(state, loss)
        changes = [self._lost(slot)]
        self._index(slot)
        return changes

    def deadline(self, identity: LeaseIdentity) -> float | None:
        """The local deadline of the lease held for ``identity`` (``None`` if none is held,
        or the identity is not run): what an ``on_expiring`` report counts down to."""
        slot = self.slots.get(identity)
        return slot.state.deadline if slot is not None and slot.holding \
            and slot.state is not None else None

    def loss(self, identity: LeaseIdentity) -> LeaseLoss | None:
        """The binding's last loss, if it holds no lease now (``None`` otherwise, or if it
        never held one)."""
        slot = self.slots.get(identity)
        if slot is None:
            return self.ended.get(identity)
        return None if slot.state is None else slot.state.loss

    # -- notices ------------------------------------------------------------------------------

    def worth_confirming(self, identity: LeaseIdentity, epoch: int) -> bool:
        """Whether a notice that ``identity``'s lease is now at ``epoch`` is worth a
        confirming read: only for a registered binding, and while holding only if ``epoch``
        is newer than the lease held (the notice of the supervisor's own takeover is not).
        What a notice says is never believed; this only saves reads."""
        slot = self.slots.get(identity)
        if slot is None or slot.handing:
            # Being handed to another fleet member: its successor's takeover may come
            # before this release's answer, and is no loss to confirm.
            return False
        return newer(None if not slot.holding or slot.state is None else slot.state.lease,
                     epoch)

    def look(self, identity: LeaseIdentity, now: float) -> Look:
        """A notice came for ``identity``: if it is a binding waiting for a lease held
        elsewhere, its next read is moved to ``now`` (joining the next turn's batched read),
        but not sooner than ``max_backoff`` after its last read, so that a peer releasing
        thousands of leases costs a few batched reads and no confirming turns. Answers
        ``"moved"`` if the read moved earlier; ``"soon"`` if the binding read less than
        ``max_backoff`` ago, or its read is in flight: the notice is still a reason to look
        now, as a confirming turn of the notice confirmer, whose bound for the process keeps
        a flood, forged or not, cheap (the read is moved to ``max_backoff`` after the last
        one meanwhile); but a fleet member awaiting the binding's hand-off moves its read to
        a short pause after the last one (``Membership.notice_pause``), or while its read
        is in flight to once its answer is in, ``"moved"``, with no confirming turn;
        ``"no"`` if nothing is to be done (its read or an acquire or takeover is due
        already, or in flight, or in a fleet the binding is preferred to another member);
        ``"held"`` if it is not a waiting binding (held, or not registered: a held one's
        notice is confirmed by :meth:`notice`)."""
        slot = self.slots.get(identity)
        if slot is None and self.fleet is not None and self.fleet.noticed(identity, now):
            return "moved"  # a member lease changed: the member set is read in the next turn
        if slot is None or slot.holding:
            return "held"
        backoff = pause = slot.binding.timing.max_backoff
        if self.fleet is not None:  # a hand-off to this member is awaited: read it sooner
            fleet_pause = self.fleet.notice_pause(identity, backoff)
            if fleet_pause is None:
                return "no"  # another member's to act on
            pause = fleet_pause
        if slot.busy:
            if slot.step is not ReadHolder:
                # An acquire or takeover in flight: its answer settles what the notice may
                # tell (often of that very takeover), so no read is worth making.
                return "no"
            # The read in flight may predate the change: look again once it is in. An
            # awaited hand-off's read is made again as soon as the answer is in (hinted: at
            # most one more read per notice, a short pause apart); any other as a
            # confirming turn (look_now), so that a flood cannot keep it reading.
            if pause < backoff:
                slot.hinted = True
                return "moved"
            self._soon.add(slot)
            return "soon"
        if slot.step is not ReadHolder:
            return "no"  # an acquire or a takeover is due already
        at = max(now, slot.looked + pause)
        if at <= now:
            if slot.try_at <= now:
                return "no"  # due already
            slot.try_at = now
            self._index(slot)
            return "moved"
        if at < slot.try_at:
            slot.try_at = at
            self._index(slot)
            if pause < backoff:
                # An awaited hand-off read a moment ago: its read comes a short pause after
                # that one, which the turn's sleep now ends for; no confirming turn is
                # needed, so a share of thousands released at once is no flood.
                return "moved"
        elif pause < backoff:
            return "no"  # its read comes that soon already
        # Read less than max_backoff ago (its next read may come sooner by its backoff): the
        # notice is still a reason to look now, within the confirmer's bound.
        self._soon.add(slot)
        return "soon"

    def look_now(self, now: float) -> bool:
        """The confirming turn of the notices :meth:`look` answered ``"soon"`` for: every
        such binding still waiting reads its holder at ``now`` (in the next turn's batched
        read). Whether any read moved."""
        soon, self._soon = self._soon, set()
        moved = False
        for slot in soon:
            if slot.removed or slot.holding or slot.step is not ReadHolder:
                continue
            if slot.busy:
                # Its read is in flight: the view it brings is acted on at once (_observe),
                # and this turn ends once the next turn is over.
                slot.hinted = moved = True
            elif slot.try_at > now:
                slot.try_at, moved = now, True
                self._index(slot)
        return moved

    def notice(self, identity: LeaseIdentity) -> Slot | None:
        """A confirming turn for ``identity`` begins: its read is made by the next turn that
        finds the slot free (:meth:`due`). The slot, or ``None`` if not registered."""
        slot = self.slots.get(identity)
        if slot is not None:
            slot.confirm = True
            self._confirms.add(slot)
        return slot

    # -- the fleet (mos_lease.keep.fleet) -----------------------------------------------

    def members_read(self, views: Sequence[HolderView | None] | BaseException, now: float
                     ) -> list[tuple[Slot, str]]:
        """After the member read of the fleet: its views, or what it raised. The campaigning
        bindings the placement now prefers to this member read their holder again at once.
        Returns the held bindings to hand over, each with its
        successor, marked busy and ``handing`` (:meth:`lease` answers ``None`` for them);
        a binding with grants minted and not yet expired is marked ``handing`` at once and
        returned by the first member read after they have expired (at most :data:`DRAIN`
        seconds), if the placement still prefers another member for it."""
        fleet = self.fleet
        assert fleet is not None
        if isinstance(views, BaseException):
            log.warning("mos_lease: fleet member read failed: %r; trying again in %.3f s",
                        views, fleet.fleet.look)
            return []
        for identity in fleet.read(views, now):
            slot = self.slots.get(identity)
            if slot is not None and not slot.busy and not slot.holding \
                    and slot.step is ReadHolder and slot.try_at > now:
                slot.try_at = now
                self._index(slot)
        held = [slot.binding.identity for slot in self.slots.values()
                if slot.holding and not slot.busy and not slot.handing]
        moves = []
        for identity, successor in fleet.hand_offs(held).items():
            slot = self.slots[identity]
            slot.handing = True
            if slot.granted_until > now:  # grants in flight: they may finish first
                self._draining[slot] = min(slot.granted_until, now + DRAIN)
                continue
            slot.busy = True
            self._index(slot)
            moves.append((slot, successor))
        for slot, until in list(self._draining.items()):
            if slot.busy or now < until:
                continue
            del self._draining[slot]
            drained = fleet.hand_offs([slot.binding.identity] if slot.holding
                                      and not slot.removed else []).get(slot.binding.identity)
            if drained is None:  # lost, removed, or preferred here again: not handed
                slot.handing = False
                continue
            slot.busy = True
            self._index(slot)
            moves.append((slot, drained))
        return moves

    @staticmethod
    def handing(slot: Slot) -> LeaseHandle:
        """The lease of a slot being handed over."""
        return _held(slot).lease

    def claim(self, slot: Slot) -> None:
        """``slot``'s lease is about to be released by a hand-off: no renewal or confirming
        read of it is planned until :meth:`handed`."""
        slot.busy = True
        self._index(slot)

    def handed(self, slot: Slot, outcome: LeaseResult | BaseException | None,
               successor: str, now: float, hold_off: float | None = None) -> list[Change]:
        """After the release that hands ``slot``'s lease to ``successor`` (its result, what
        it raised, or ``None``: not sent). Released: a :class:`Moved` change, and the binding
        leaves that release to the successor for ``hold_off`` seconds (default: the fleet's
        grace period) before it campaigns again, notices or not.
        Otherwise the lease is still held and renewed (and, in a fleet, the next member read
        tries again); a lease lost meanwhile is found by its renewal, as any loss is."""
        slot.busy = slot.handing = False
        state = slot.state
        fleet = self.fleet
        if slot.removed or state is None or state.loss is not None \
                or not isinstance(outcome, LeaseResult) or not outcome.ok:
            if outcome is not None and not slot.removed:
                log.warning("mos_lease: could not hand %s over to %s: %r",
                            slot.binding.identity, successor,
                            outcome.reason if isinstance(outcome, LeaseResult) else outcome)
            self._index(slot)
            return []
        if hold_off is None:
            assert fleet is not None
            hold_off = fleet.fleet.grace.total_seconds()
        slot.state = lose(state, LeaseLoss(LossCause.STOPPED, Reason.LEASE_RELEASED, now))
        slot.step, slot.observed, slot.hinted = ReadHolder, None, False
        slot.try_at = now + hold_off
        slot.held_off = (state.lease.epoch, slot.try_at)
        if fleet is not None:
            fleet.handed += 1
        self._index(slot)
        log.info("mos_lease: %s handed over to %s", slot.binding.identity, successor)
        return [Moved(slot.binding.identity, state.lease, successor)]

    # -- deciding -----------------------------------------------------------------------------

    def due(self, now: float) -> Due:
        """The calls due at ``now`` (their slots are marked busy) and the losses found.

        Only the slots with something due are looked at, found on the timelines: the free
        held leases whose deadline has passed (lost), whose renewal or coalescing window has
        come (when one renewal is due, the others of its window go with it), the
        campaigning slots whose try has come, and those with a confirming read asked for.
        The answer is the one a look at every slot would give, in registration order (a
        fleet member's campaign calls for the bindings preferred to it first)."""
        live = len(self.slots)
        for timeline in (self._deadlines, self._renewals, self._windows, self._tries):
            timeline.compact(live)  # once a turn: the stale entries of the last one's changes
        changes: list[Change] = []
        for slot in sorted(self._deadlines.pop_until(now, keep=_busy), key=_order):
            changes += self._judge(slot, now)
            if slot.holding:  # not expected (its deadline has passed): keep it indexed
                self._index(slot)
        # Whether a renewal is strictly due: only then do the early ones go too.
        renewing = self._renewals.first() <= now
        looked = set(self._tries.pop_until(now))  # the slots lost above among them
        if renewing:
            looked.update(self._windows.pop_until(now))
        confirming = [slot for slot in self._confirms if slot.confirm and not slot.removed]
        looked.update(slot for slot in confirming if not slot.busy)
        campaigns: list[Campaign] = []
        confirms: list[Confirm] = []
        noticed: list[Slot] = []  # held, with a confirming read asked for
        groups: dict[float, list[Slot]] = {}
        for slot in sorted(looked, key=_order):
            state = slot.state
            if state is not None and state.loss is None:
                if renewing and now >= self._window(slot, state):
                    groups.setdefault(slot.binding.timing.ttl, []).append(slot)
                if slot.confirm:
                    noticed.append(slot)
            elif slot.confirm:
                # The campaign's next look, made at once: a notice may mean the lease was
                # released or taken over, and a read is what the campaign would do anyway.
                confirms.append(Confirm(slot, None))
            elif now >= slot.try_at:
                campaigns.append(self._campaign(slot))
        fleet = self.fleet
        if fleet is not None:
            # A fleet member's reads of the bindings preferred to it first (a share it
            # gains, to take over as soon as it is released), then its looks at the others.
            campaigns.sort(key=lambda call: not fleet.preferred_here(call.slot.binding.identity))
        renewals: list[RenewalBatch] = []
        for ttl, members in groups.items():
            for first in range(0, len(members), BATCH):
                batch = tuple(members[first:first + BATCH])
                for slot in batch:
                    slot.busy = True
                renewals.append(RenewalBatch(batch, tuple(_held(s).lease for s in batch), ttl,
                                      math.inf, now))
        # The next renewal of the held leases left free (the early ones wait for the first
        # that is strictly due); a held one with a confirming read counts, as it is only
        # made busy below.
        wake_at = self._renewals.first()
        # A lease renewed in this tick is confirmed on the next one (the slot is busy now):
        # the renewal comes first, and its answer may already settle the question.
        confirms += [Confirm(slot, _held(slot).lease) for slot in noticed if not slot.busy]
        for call in campaigns:
            call.slot.busy = True
        for confirm in confirms:
            confirm.slot.busy, confirm.slot.confirm = True, False
        self._confirms = {slot for slot in confirming if slot.confirm}
        # The next try of the campaigning slots left free, and the fleet's next member read.
        wake_at = min(wake_at, self._tries.first())
        if self.fleet is not None:
            wake_at = min(wake_at, self.fleet.next_read())
        return Due(changes, renewals, campaigns, wake_at, confirms)

    def earliest_deadline(self) -> float:
        """The earliest local deadline of the held leases (``inf`` if none is held): how
        long any call may keep the driver waiting."""
        return self._deadlines.first()

    def limits(self, renewals: Sequence[RenewalBatch]) -> tuple[float, list[float]]:
        """For a tick sending ``renewals``: the earliest deadline of the held leases outside
        them, and of each batch's. The time limit of batch ``k`` is the least of the first,
        of the batches from ``k`` on, and of the leases of earlier batches that are still
        held (see :meth:`deadlines`): one pass over the tick's leases, not one per batch,
        and none over the others."""
        claimed = {slot for renew in renewals for slot in renew.slots}
        rest = self._deadlines.first_except(claimed.__contains__)
        return rest, [self.deadlines(renew.slots) for renew in renewals]

    @staticmethod
    def deadlines(slots: Sequence[Slot]) -> float:
        """The earliest deadline of the leases of ``slots`` still held (``inf`` if none)."""
        return min((s.state.deadline for s in slots
                    if not s.removed and s.state is not None and s.state.loss is None),
                   default=math.inf)

    def urgent_at(self) -> float:
        """When the next renewal or deadline of a held lease comes (``inf`` if none)."""
        return min(self._renewals.first(), self._deadlines.first_except(_busy))

    def _window(self, slot: Slot, state: KeeperState) -> float:
        """When ``state``'s renewal may join a batch: up to :data:`COALESCE` of its renewal
        interval early, unless it is a retry (due at its own time)."""
        if state.failures:
            return state.renew_at
        timing = slot.binding.timing
        return state.renew_at - self._coalesce * timing.ttl * timing.renew_fraction

    def _index(self, slot: Slot) -> None:
        """Put ``slot`` on the timelines its state belongs on, after any change to it: its
        old entries go stale (a new version). A busy slot is only on the deadlines (if
        held); it is indexed again when its call is judged or given back (:meth:`free`)."""
        slot.version += 1
        if slot.removed:
            return
        state = slot.state
        if state is not None and state.loss is None:
            self._deadlines.push(state.deadline, slot)
            if not slot.busy:
                self._renewals.push(state.renew_at, slot)
                self._windows.push(self._window(slot, state), slot)
        elif not slot.busy:
            self._tries.push(slot.try_at, slot)
        if slot.confirm:
            self._confirms.add(slot)

    def _judge(self, slot: Slot, now: float) -> list[Change]:
        state = slot.state
        if state is None or state.loss is not None:
            return []
        action = next_action(state, now)
        if not isinstance(action, ReportLoss):
            return []
        slot.state = lose(state, action.loss)
        changes = [self._lost(slot)]
        self._index(slot)
        return changes

    def _lost(self, slot: Slot) -> Change:
        """Report the recorded loss; campaign again at once (unless removed): reading the
        holder shows whether the lease is still ours, active, or takeable."""
        state = slot.state
        assert state is not None and state.loss is not None
        level = logging.INFO if state.loss.cause is LossCause.STOPPED else logging.WARNING
        log.log(level, "mos_lease: lease %s lost: %s (%s)%s", state.lease.identity,
                state.loss.cause, state.loss.reason,
                f" last error: {state.loss.error}" if state.loss.error else "")
        if self.telemetry is not None:
            self.telemetry.append(events.loss(state.lease, str(state.loss.cause),
                                              state.loss.reason))
        slot.step, slot.observed, slot.try_at = ReadHolder, None, state.loss.at
        slot.hinted = False
        if slot.binding.once and not slot.removed:
            # Held once (hold()'s binding): the loss ends it, no campaign follows; it is no
            # longer run, as after a give-up; asked about, it holds nothing.
            self._drop(slot)
            self.ended[slot.binding.identity] = state.loss
        return BindingLost(slot.binding.identity, state.lease, state.loss)

    def writes_due(self, slots: Iterable[Slot], now: float) -> list[Campaign]:
        """The acquires and takeovers due at ``now`` among ``slots``, whose reads were just
        judged, claimed (busy) for the turn that read them to make at once: a write decided
        on a read is made right after it, not after the rest of that turn's reads (a member
        whose share grows reads a few thousand bindings in a turn, the ones it gains among
        them)."""
        calls: list[Campaign] = []
        for slot in slots:
            if slot.busy or slot.removed or slot.holding or slot.step is ReadHolder \
                    or slot.try_at > now:
                continue
            calls.append(self._campaign(slot))
            slot.busy = True
            self._index(slot)  # off the tries timeline while its call is made
        return calls

    def _campaign(self, slot: Slot) -> Campaign:
        step = slot.step
        if step is AcquireDue:
            return AcquireDue(slot)
        if step is ReadHolder:
            return ReadHolder(slot)
        assert isinstance(step, int)
        return TakeoverDue(slot, step, slot.observed)

    # -- outcomes -----------------------------------------------------------------------------

    def renewed(self, call: RenewalBatch, outcome: Sequence[LeaseResult] | BaseException | None,
                started: float, finished: float, limit: float = -math.inf) -> list[Change]:
        """After a ``heartbeat_many`` that started at ``started`` and returned at
        ``finished``: its results (in order), the exception it raised, or ``None`` if it was
        abandoned at its time limit ``limit`` (see :func:`~mos_lease.keep.turn.turn`). Each
        lease is judged on its own by the keeper's rule (an abandoned one by
        :func:`~mos_lease.keep.timing.abandoned`)."""
        if not isinstance(outcome, BaseException | None) and len(outcome) != len(call.slots):
            outcome = StoreUnavailable(f"heartbeat_many returned {len(outcome)} results for "
                                       f"{len(call.slots)} leases")
        changes: list[Change] = []
        debug = log.isEnabledFor(logging.DEBUG)  # asked once a batch: 1,000 leases each
        for k, slot in enumerate(call.slots):
            slot.busy = False
            state = slot.state
            if slot.removed or state is None or state.loss is not None \
                    or state.lease is not call.leases[k]:
                # Removed, or lost while the call was in flight: nothing to undo (free again).
                self._index(slot)
                continue
            if outcome is None:  # abandoned at the batch's limit
                new = abandoned(state, slot.binding.timing, started, finished, limit,
                                self._draw())
            else:
                single = outcome if isinstance(outcome, BaseException) else outcome[k]
                # The deadline counts from this call's start, as it must; the next renewal
                # from the tick's, so the batches of a tick that took a while stay one tick
                # (renewing a little early only moves deadlines later).
                new = after_renewal(state, slot.binding.timing, started, finished, single,
                                    self._draw(), min(call.tick, started))
                # A transient failure (an error, or a lease the batch did not reach) is
                # retried until this lease's own deadline; the others are judged apart.
                if new.loss is None and new.failures > state.failures:
                    log.warning("mos_lease: renewal of %s failed (attempt %d): %s; retrying "
                                "in %.3f s, %.3f s before the local deadline",
                                state.lease.identity, new.failures, new.last_error,
                                max(0.0, new.renew_at - finished), new.deadline - finished)
            slot.state = new
            if debug and new.loss is None and new.failures == 0:
                log.debug("mos_lease: renewed %s connector=%s epoch=%d in %.3f s",
                          new.lease.identity, new.lease.connector_id, new.lease.epoch,
                          finished - started)
            if new.loss is not None:
                changes.append(self._lost(slot))
            elif self.telemetry is not None:
                self.telemetry.append(_kept(state, new, outcome, k, finished - started,
                                            finished))
            self._index(slot)
        return changes

    def campaigned(self, call: Campaign, outcome: LeaseResult | HolderView | BaseException
                   | None, started: float, finished: float
                   ) -> tuple[list[Change], LeaseHandle | None]:
        """After a campaign call that started at ``started`` and returned at ``finished``:
        its result (a :class:`LeaseResult`, a :class:`HolderView` or ``None`` for a read),
        or the exception it raised. Returns the changes and a lease won for a binding
        removed meanwhile, which the driver must release."""
        try:
            return self._campaigned(call, outcome, started, finished)
        finally:
            self._index(call.slot)

    def _campaigned(self, call: Campaign, outcome: LeaseResult | HolderView | BaseException
                    | None, started: float, finished: float
                    ) -> tuple[list[Change], LeaseHandle | None]:
        slot = call.slot
        slot.busy = False
        won = (outcome.lease if isinstance(outcome, LeaseResult) and outcome.ok else None)
        if slot.removed:
            return [], won
        if isinstance(outcome, BaseException):
            # A store failure, or anything else: no lease is held, so nothing is unsafe;
            # back off and read the holder again.
            slot.reason = Reason.STORE_UNAVAILABLE
            slot.error = f"{type(outcome).__name__}: {outcome}"
            return self._pause(slot, finished, ReadHolder, None), None
        if isinstance(call, ReadHolder):
            assert not isinstance(outcome, LeaseResult)
            return self._observe(slot, outcome, finished, pause=False), None
        assert isinstance(outcome, LeaseResult)
        if won is not None:
            if self.fleet is not None:  # counted, and its own lease read with it at once
                self.fleet.won(slot.binding.identity, slot.observed, won, finished)
            slot.state = held(slot.binding.timing, won, started, self._draw())
            slot.failures = 0
            slot.gives_up_at = None  # the wait is over: after a loss, campaign until removed
            slot.seen = (won.connector_id, won.epoch)
            slot.observed = None
            return [BindingStarted(slot.binding.identity, won)], None
        assert outcome.reason is not None
        slot.reason, slot.error = outcome.reason, None
        slot.preempt_refused |= outcome.reason is Reason.PREEMPTION_DENIED
        if outcome.reason not in RETRY_REASONS:
            # Waiting cannot change it: a binding with a wait, or held once (hold()'s,
            # whose wait may be without limit), gives up at once.
            if slot.binding.wait is not None or slot.binding.once:
                return self._give_up(slot), None
            log.warning("mos_lease: campaign for %s refused: %s; trying again later",
                        slot.binding.identity, outcome.reason)
        if outcome.holder is not None:  # the refusal shows the lease: no read needed
            return self._observe(slot, outcome.holder, finished, pause=True), None
        return self._pause(slot, finished, ReadHolder, None), None

    def confirmed(self, call: Confirm, outcome: HolderView | BaseException | None,
                  finished: float) -> list[Change]:
        """After the confirming read of ``call`` returned at ``finished`` (its view, or the
        exception it raised). A held lease that another holder or epoch superseded is lost
        at once (cause ``DENIED``; the new holder is reported and the campaign acts on the
        view: a released or expired lease is taken over at once, an active one waited for).
        While campaigning the view is the campaign's next look. A read that failed confirms
        nothing: the renewals, or the campaign, go on as they were."""
        try:
            return self._confirmed(call, outcome, finished)
        finally:
            self._index(call.slot)

    def _confirmed(self, call: Confirm, outcome: HolderView | BaseException | None,
                   finished: float) -> list[Change]:
        slot = call.slot
        slot.busy = False
        if slot.removed or isinstance(outcome, BaseException):
            return []
        if call.held is None:
            if slot.holding:
                return []  # held meanwhile (never while the read was in flight: it is busy)
            return self._observe(slot, outcome, finished, pause=False)
        state = slot.state
        if state is None or state.loss is not None or state.lease is not call.held:
            return []  # lost, or held anew, while the read was in flight
        loss = superseded(call.held, outcome, finished)
        if loss is None:
            return []
        slot.state = lose(state, loss)
        lost = self._lost(slot)
        if slot.removed:  # held once: nothing more to campaign for
            return [lost]
        return [lost, *self._observe(slot, outcome, finished, pause=False)]

    def _observe(self, slot: Slot, view: HolderView | None, now: float,
                 pause: bool) -> list[Change]:
        """Act on ``view``: try at once what it allows (after a pause if ``pause``), or wait
        for the observed lease to expire or the backoff to pass, whichever is first."""
        changes: list[Change] = []
        if view is not None and slot.seen != (view.connector_id, view.epoch):
            slot.seen = (view.connector_id, view.epoch)
            changes.append(NewHolder(slot.binding.identity, view))
        # The campaign rule (campaign.next_try), as hold() waits by it: an identity that
        # never had a lease is acquired, an active lease is waited out (or preempted, under
        # PREEMPT), an expired or released one is taken over at the epoch just read, so of
        # several campaigners one wins.
        slot.looked = now
        held_off = slot.held_off
        if held_off is not None and view is not None and view.state is LeaseState.RELEASED \
                and view.epoch == held_off[0] and now < held_off[1]:
            # Its own hand-off's release: the successor's to take over until the hold-off
            # ends, whatever notice brought this read forward.
            return changes + self._gated(slot, view, now, held_off[1] - now)
        if self.fleet is not None and slot.binding.identity != self.fleet.identity:
            # The fleet's campaign gate first: never against an active lease, at once for a
            # binding preferred to this member, after the grace period for any other.
            wait = self.fleet.judge(slot.binding.identity, view, now)
            if wait is not None:
                return changes + self._gated(slot, view, now, wait)
        planned = next_try(view, slot.binding.takeover, slot.preempt_refused)
        if isinstance(planned, Reason):
            slot.reason, slot.error, slot.observed = planned, None, view
            changes += self._pause(slot, now, ReadHolder, view)
            if slot.hinted:  # a confirmed notice came while this view was read: look again
                slot.try_at = now
            slot.hinted = False
            return changes
        slot.hinted = False
        step: type[AcquireDue] | int = AcquireDue if planned == ACQUIRE else planned
        if pause:
            changes += self._pause(slot, now, step, view)
        else:
            slot.step, slot.try_at = step, now
        slot.observed = view
        return changes

    def _pause(self, slot: Slot, now: float, step: type[AcquireDue] | type[ReadHolder] | int,
               view: HolderView | None) -> list[Change]:
        """Try ``step`` again after a backoff, never past the end of the binding's wait;
        give up (the changes to report) if that end has come."""
        ends = slot.gives_up_at
        if ends is not None and now >= ends:
            return self._give_up(slot)
        slot.failures += 1
        slot.step = step
        slot.try_at = now + pause_for(slot.binding.timing, slot.failures, self._draw(),
                                      None if ends is None else ends - now, view,
                                      until_expiry=self.noticed)
        return []

    def _gated(self, slot: Slot, view: HolderView | None, now: float, wait: float
               ) -> list[Change]:
        """The fleet's gate says wait ``wait`` seconds before reading again: without
        notices, no longer than ``max_backoff`` (as any campaign waits for an active lease),
        never sooner than ``min_backoff``, never past the end of the binding's wait."""
        timing = slot.binding.timing
        if not self.noticed:
            wait = min(wait, timing.max_backoff)
        if slot.hinted:
            # A notice came while this view was read (a release, maybe, that the view
            # predates): read again at once, as an ungated campaign does.
            wait = 0.0
        slot.reason, slot.error, slot.observed, slot.hinted = Reason.LEASE_HELD, None, view, False
        slot.step, slot.try_at = ReadHolder, now + max(wait, timing.min_backoff)
        if slot.gives_up_at is not None:
            if now >= slot.gives_up_at:
                return self._give_up(slot)
            slot.try_at = min(slot.try_at, slot.gives_up_at)
        return []

    def _drop(self, slot: Slot) -> None:
        """``slot`` is no longer run (it gave up, or lost a lease it held once)."""
        if self.slots.get(slot.binding.identity) is slot:
            del self.slots[slot.binding.identity]
            if self.fleet is not None:
                self.fleet.remove(slot.binding.identity)
        slot.removed = True
        slot.version += 1  # off every timeline

    def _give_up(self, slot: Slot) -> list[Change]:
        """The binding stops campaigning and is no longer run: its wait ran out, or a refusal
        waiting cannot change ended it. It never held a lease in this wait, so nothing is to
        release, and no notice confirmation was ever asked for it (those are for held
        bindings)."""
        identity = slot.binding.identity
        self._drop(slot)
        log.info("mos_lease: gave up campaigning for %s: %s", identity, slot.reason)
        return [GaveUp(identity, slot.reason, slot.observed, slot.error)]


def newer(held: LeaseHandle | None, epoch: int) -> bool:
    """Whether a notice that the lease is now at ``epoch`` is worth a confirming read for
    whoever holds ``held`` (``None``: holds nothing): only an epoch newer than the one held
    (the notice of one's own takeover is not). The one filter of :func:`~mos_lease.hold`'s
    notices and the supervisor's; what a notice says is never believed, this only saves
    reads."""
    return held is None or epoch > held.epoch


def superseded(held: LeaseHandle, view: HolderView | None, at: float) -> LeaseLoss | None:
    """The loss of ``held`` that the store's ``view`` read at ``at`` shows, or ``None``: a
    newer epoch (another holder's takeover) or ``held``'s own epoch released. The one rule
    of a notice-confirmed loss, for :func:`~mos_lease.hold` and the supervisor."""
    if view is None or view.epoch < held.epoch:
        return None
    if view.epoch > held.epoch:
        return LeaseLoss(LossCause.DENIED, Reason.STALE_EPOCH, at,
                         f"read after a notice: epoch {view.epoch} held by "
                         f"{view.connector_id}")
    if view.state is LeaseState.RELEASED:
        return LeaseLoss(LossCause.DENIED, Reason.LEASE_RELEASED, at,
                         "read after a notice: released")
    return None


def _kept(state: KeeperState, new: KeeperState,
          outcome: Sequence[LeaseResult] | BaseException | None, k: int, duration: float,
          finished: float) -> events.Renewed | events.RenewalRetry:
    """The telemetry of lease ``k`` of a renewal that kept it (``new`` has no loss):
    renewed, or retried after a transient failure of the cause the outcome shows."""
    if new.failures <= state.failures:
        return events.renewal(new.lease, duration)
    single = outcome if outcome is None or isinstance(outcome, BaseException) else outcome[k]
    cause = (StoreUnavailable.__name__ if single is None  # abandoned at the batch's limit
             else str(single.reason) if isinstance(single, LeaseResult)
             else type(single).__name__)
    return events.renewal(new.lease, duration, cause, new.failures,
                          max(0.0, new.renew_at - finished))


def _order(slot: Slot) -> int:
    return slot.order


def _busy(slot: Slot) -> bool:
    return slot.busy


# Whether a timeline's entry pushed at ``version`` still places ``slot`` there: the same
# version (no change since), not removed, and in the state the timeline holds.
# (A removed slot's version moves on as it is removed: its entries are all stale.)
def _holding(slot: Slot, version: int) -> bool:
    return version == slot.version and (state := slot.state) is not None \
        and state.loss is None


def _free_holding(slot: Slot, version: int) -> bool:
    return version == slot.version and not slot.busy and (state := slot.state) is not None \
        and state.loss is None


def _free_campaigning(slot: Slot, version: int) -> bool:
    return version == slot.version and not slot.busy \
        and ((state := slot.state) is None or state.loss is not None)


def _held(slot: Slot) -> KeeperState:
    assert slot.state is not None
    return slot.state

