"""The supervisor's bindings and the calls it makes for them: :class:`Binding` (what the
gateway registered), :class:`Slot` (one binding's state, held or campaigning) and the calls
:meth:`~mos_lease.keep.schedule.Schedule.due` asks a driver to make (a campaign call
for one slot, a renewal for a batch of them). Plain values, apart from the schedule that
decides with them.
"""

from __future__ import annotations

import math

import attrs

from mos_lease.identity import LeaseIdentity
from mos_lease.keep.campaign import TakeoverPolicy
from mos_lease.keep.changes import Change
from mos_lease.keep.timing import KeeperState, KeeperTiming
from mos_lease.metadata import EMPTY_METADATA, Metadata
from mos_lease.records import LeaseHandle
from mos_lease.results import HolderView
from mos_lease.vocabulary import Reason

# --- what the gateway registered, and the state of each binding ----------------------------


@attrs.frozen(slots=True)
class Binding:
    """A binding the supervisor runs: who, as which connector, with which scopes and timing.
    The scopes are those :func:`~mos_lease.identity.normalize_scopes` returned; ``metadata``
    is the holder metadata each of its acquires and takeovers sets. ``takeover`` is the
    campaign's :class:`~mos_lease.keep.campaign.TakeoverPolicy`; ``wait`` the seconds
    the first campaign may take before the binding gives up (``inf``: no limit, but a refusal
    that waiting cannot change still ends it; ``None``: campaign until removed, whatever is
    refused). ``once``: the lease is held once, as :func:`~mos_lease.hold` holds it: its
    loss ends the binding (it is no longer run) instead of a new campaign."""

    identity: LeaseIdentity
    connector_id: str
    scopes: tuple[str, ...]
    timing: KeeperTiming
    metadata: Metadata = EMPTY_METADATA
    takeover: TakeoverPolicy = TakeoverPolicy.EXPIRED
    wait: float | None = None
    once: bool = False


class Slot:
    """One registered binding: either holding (``state`` without a loss) or campaigning
    (``step`` is tried at ``try_at``). ``busy`` while a call for it is in flight; ``confirm``
    while a notice's confirming read waits for its turn. Compared by identity: a call whose
    slot was removed (or replaced by a new registration) is stale. ``order`` is its place
    among the registrations (the schedule answers in that order), ``version`` counts the
    changes the schedule's timelines have seen (:mod:`~mos_lease.keep.timeline`: an
    entry of an older version is stale)."""

    __slots__ = ("binding", "busy", "confirm", "error", "failures", "gives_up_at",
                 "granted_until", "handing", "held_off", "hinted", "looked", "observed", "order",
                 "preempt_refused", "reason", "removed", "seen", "state", "step", "try_at",
                 "version")

    def __init__(self, binding: Binding, now: float, order: int = 0) -> None:
        self.binding = binding
        self.order = order
        self.version = 0
        self.state: KeeperState | None = None  # the held lease (until lost)
        # A new binding reads its holder first, as after a loss: a binding held elsewhere
        # costs no write and no audit row, and the ones never held are then acquired
        # together (the reads and acquires of a turn are batched: flow.batches).
        self.step: type[AcquireDue] | type[ReadHolder] | int = ReadHolder  # int: take over at it
        self.observed: HolderView | None = None  # the view a takeover acts on
        self.try_at = now
        self.looked = -math.inf  # when the campaign last read the holder
        self.hinted = False  # a notice came while a campaign call was in flight
        self.failures = 0
        self.seen: tuple[str, int] | None = None  # the last (connector_id, epoch) reported
        self.busy = False
        self.confirm = False  # a notice asked for a confirming read (mos_lease.notice_gate)
        self.removed = False
        self.handing = False  # being handed over: drained, or its release in flight
        # When the grants minted for its lease have all expired, at the latest: a hand-off's
        # drain waits for them (mos_lease.keep.handover).
        self.granted_until = -math.inf
        # After a hand-off of the lease at an epoch: until when (monotonic) its release at
        # that epoch is left for the successor to take over, not campaigned for.
        self.held_off: tuple[int, float] | None = None
        # The first campaign's end (Binding.wait), and what a give-up then reports: the last
        # reason the lease could not be had, the last store error, whether a preemption
        # was refused (PREEMPT then waits like EXPIRED).
        self.gives_up_at = None if binding.wait is None else now + binding.wait
        self.reason = Reason.LEASE_HELD
        self.error: str | None = None
        self.preempt_refused = False

    @property
    def holding(self) -> bool:
        return self.state is not None and self.state.loss is None


# --- the calls the schedule asks a driver to make ------------------------------------------


@attrs.frozen(slots=True, eq=False)
class AcquireDue:
    slot: Slot


@attrs.frozen(slots=True, eq=False)
class TakeoverDue:
    """Take over at ``expected_epoch``, passing ``observed`` (the coordinator's own view at
    that epoch, so the takeover needs no read of its own)."""

    slot: Slot
    expected_epoch: int
    observed: HolderView | None


@attrs.frozen(slots=True, eq=False)
class ReadHolder:
    slot: Slot


Campaign = AcquireDue | TakeoverDue | ReadHolder


@attrs.frozen(slots=True, eq=False)
class Confirm:
    """Read the holder because a notice came for the binding: ``held`` is the lease held
    when the read was planned (the read then tells whether another holder or epoch
    superseded it), ``None`` while campaigning (the read is then the campaign's next look,
    made at once)."""

    slot: Slot
    held: LeaseHandle | None


@attrs.frozen(slots=True, eq=False)
class RenewalBatch:
    """One ``heartbeat_many`` call for ``leases`` (of ``slots``, in order) with ``ttl``; it
    must return within ``timeout`` seconds of its start, when the earliest local deadline of
    the held leases comes (set by the turn as the call starts). The driver starts it and
    answers at once with a ticket, which the turn waits for later
    (:class:`~mos_lease.keep.turn.Collect`): two batches may be in flight at once."""

    slots: tuple[Slot, ...]
    leases: tuple[LeaseHandle, ...]
    ttl: float
    timeout: float
    tick: float  # when the tick that sends it was decided: the next is due from there


@attrs.frozen(slots=True)
class Due:
    """What :meth:`~mos_lease.keep.schedule.Schedule.due` found: changes to report
    (losses at their deadline), the renewals, campaign calls and confirming reads to make now,
    and when to look again if nothing happens."""

    changes: list[Change]
    renewals: list[RenewalBatch]
    campaigns: list[Campaign]
    wake_at: float
    confirms: list[Confirm] = attrs.field(factory=list)
