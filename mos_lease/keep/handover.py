"""A planned hand-off of one binding to a named successor (``Supervisor.handover``): the
runtime portability step, where the agent keeps its identity and the connector changes.

Written once as a generator, as the turn is (:mod:`mos_lease.keep.turn`), and driven
by the caller of ``handover()`` on the thread or asyncio supervisor alike. Its calls are a
:class:`~mos_lease.sleep.Sleep` (the drain) and the release, a
:class:`~mos_lease.keep.fleet.FleetCall`::

    check the input, ask the policy (the successor's takeover)          -- refused: result
    mark the binding handing: lease() answers None, no new grant        -- at once
    --Sleep--> until the grants minted for the lease have expired, at most ``drain`` s
    --FleetCall(release_many, correlation id "handover:<successor>")-->
    released: Moved(identity, lease, successor); the old holder waits the grace period
    before it campaigns again, so the successor, woken by the release notice (or its next
    look), takes the lease over at the observed epoch

A successor that never comes leaves the binding without a holder for that grace period at
most: then the normal campaign applies. Safety stays the lease's: the successor's takeover
is a compare-and-set on the epoch, and the old connector's grants are refused from the new
epoch on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import attrs

from mos_lease.errors import ConfigurationError, InvalidInput
from mos_lease.identity import GRANT_TTL_CAP, MAX_ID_LENGTH, LeaseIdentity, check_id
from mos_lease.keep.fleet import FleetCall
from mos_lease.keep.slots import Slot
from mos_lease.keep.turn import MAX_CALL
from mos_lease.machine import PolicyVerdict
from mos_lease.policy import PolicyRequest
from mos_lease.records import LeaseHandle
from mos_lease.results import LeaseResult
from mos_lease.sleep import Sleep
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Reason

if TYPE_CHECKING:
    from mos_lease.keep.turn import Core

HOLD_OFF: Final = 5.0
"""Seconds a supervisor outside a fleet waits after a hand-off before it campaigns for the
binding again (in a fleet, its ``grace``): the successor's time to take the lease over."""
HANDOVER_PREFIX: Final = "handover:"
"""The release of a hand-off carries the correlation id ``handover:<successor>`` in its
audit row."""
MAX_SUCCESSOR: Final = MAX_ID_LENGTH - len(HANDOVER_PREFIX)
"""The longest successor name: the audit row's correlation id must be able to name it."""
BUSY_PAUSE: Final = 0.002
"""Seconds between looks while a renewal of the lease is in flight at the drain's end."""


@attrs.frozen(slots=True)
class HandoverResult:
    """What ``handover()`` did: ``reason`` is ``None`` when the lease was released naming
    ``successor`` (``ok``); otherwise why not, a stable code: the policy's refusal of the
    successor (``policy_denied``, ``scope_not_authorized``, ``ttl_not_authorized``,
    ``preemption_denied``), or the lease lost or refused before its release (then nothing
    was handed over). ``drained``: seconds the drain took."""

    reason: Reason | None
    identity: LeaseIdentity
    lease: LeaseHandle
    successor: str
    drained: float = 0.0

    @property
    def ok(self) -> bool:
        return self.reason is None


def check_drain(value: object) -> float:
    """A drain: seconds or a ``timedelta``, from 0 to the grant cap (no grant lives
    longer, so no drain needs to)."""
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise InvalidInput("drain", f"must be seconds or a timedelta, not "
                           f"{type(value).__name__}")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    cap = GRANT_TTL_CAP.total_seconds()
    if not (math.isfinite(seconds) and 0 <= seconds <= cap):
        raise InvalidInput("drain", f"must be from 0 to {cap:g} seconds")
    return seconds


def check_successor(value: object) -> str:
    """``to``: a connector id or member name the audit row can name."""
    if isinstance(value, str) and len(value) > MAX_SUCCESSOR:
        raise InvalidInput("to", f"must be at most {MAX_SUCCESSOR} characters (the audit "
                           "row's correlation id names it)")
    return check_id("to", value)


def handover(core: Core, identity: LeaseIdentity, to: object, drain: object,
             verdict: Callable[[PolicyRequest], PolicyVerdict]
             ) -> Generator[Sleep | FleetCall, Any, HandoverResult]:
    """Hand ``identity``'s lease to ``to`` (see the module's docstring). Bad input raises
    :class:`~mos_lease.errors.InvalidInput` before anything is written or marked."""
    successor, seconds = check_successor(to), check_drain(drain)
    with core.lock:
        binding = _slot(core, identity, successor).binding
    # Asked as the successor's takeover of the lease this release leaves it: may that
    # connector hold the binding, with its scopes and ttl, after this one.
    answer = verdict(PolicyRequest(
        LifecycleEvent.TAKEOVER, identity, successor, binding.scopes,
        timedelta(seconds=binding.timing.ttl), current_state=LeaseState.RELEASED,
        current_connector_id=binding.connector_id))
    with core.lock:
        slot = _slot(core, identity, successor)  # the policy may have taken a while
        lease = core.schedule.handing(slot)
        if not answer.allowed:
            assert answer.reason is not None
            return HandoverResult(answer.reason, identity, lease, successor)
        # From now on lease() answers None for it: no new grant is minted on it.
        slot.handing = True
        started = core.clock()
    claimed, lost = yield from _drain(core, slot, started + seconds)
    if claimed is None:
        return HandoverResult(lost, identity, lease, successor, core.clock() - started)
    lease = claimed
    answer_at = core.clock()
    with core.lock:
        limit = max(min(core.schedule.earliest_deadline() - answer_at, MAX_CALL), 0.0)
    outcome = yield FleetCall(leases=(lease,), correlation_id=HANDOVER_PREFIX + successor,
                              timeout=limit)
    finished = core.clock()
    single = outcome[0] if isinstance(outcome, list) and len(outcome) == 1 else outcome
    with core.lock:
        changes = core.schedule.handed(
            slot, single if isinstance(single, LeaseResult | BaseException) else None,
            successor, finished, _hold_off(core))
    core.report(changes)
    if isinstance(single, BaseException):
        raise single
    if not isinstance(single, LeaseResult):
        raise ConfigurationError(f"release_many answered {outcome!r:.60} for one lease")
    return HandoverResult(single.reason, identity, lease, successor, answer_at - started)


def _slot(core: Core, identity: LeaseIdentity, successor: str) -> Slot:
    """The held slot of ``identity``, to be handed to ``successor`` (a connector id; a
    member of the fleet runs its bindings as its name)."""
    if core.closing:
        raise ConfigurationError("the supervisor is closed")
    schedule = core.schedule
    slot = schedule.slots.get(identity)
    fleet = schedule.fleet
    if slot is None:
        raise InvalidInput("identity", "is not supervised")
    if fleet is not None and identity == fleet.identity:
        raise InvalidInput("identity", "is this member's own lease in its fleet")
    if not slot.holding:
        raise InvalidInput("identity", "holds no lease here")
    if slot.handing:
        raise InvalidInput("identity", "is being handed over already")
    if successor == slot.binding.connector_id:
        raise InvalidInput("to", "is the binding's connector already")
    if fleet is not None and successor in fleet.fleet.members:
        if successor == fleet.fleet.member:
            raise InvalidInput("to", "is this member")
        preferred = fleet.placement.preferred(identity)
        if preferred != successor:
            # The placement decides which member holds a binding: handed to another one,
            # the fleet would move it back (or that member would wait out its grace).
            raise InvalidInput("to", f"is a member the placement does not prefer for this "
                               f"binding (it prefers {preferred!r}); hand it to a "
                               "connector outside the fleet, or change the members")
    return slot


def _drain(core: Core, slot: Slot, bound: float
           ) -> Generator[Sleep, Any, tuple[LeaseHandle | None, Reason]]:
    """Wait until the grants minted for the lease have expired (``slot.granted_until``,
    moved on by every grant minted meanwhile), but not past ``bound``, and until no
    renewal of it is in flight; then claim the slot for the release. The lease to release,
    or ``None`` with the reason it can no longer be handed over."""
    while True:
        with core.lock:
            now = core.clock()
            if slot.removed or not slot.holding or core.closing:
                slot.handing = False
                loss = core.schedule.loss(slot.binding.identity)
                return None, Reason.LEASE_RELEASED if loss is None else loss.reason
            wait = min(bound, slot.granted_until) - now
            if wait <= 0 and not slot.busy:
                core.schedule.claim(slot)  # no renewal or confirming read of it from now on
                return core.schedule.handing(slot), Reason.LEASE_RELEASED
        yield Sleep(wait if wait > 0 else BUSY_PAUSE)


def _hold_off(core: Core) -> float:
    fleet = core.schedule.fleet
    return HOLD_OFF if fleet is None else fleet.fleet.grace.total_seconds()
