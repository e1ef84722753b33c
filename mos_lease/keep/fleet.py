"""The fleet's part of a supervisor turn (``Supervisor(..., fleet=...)``): read the member set,
and hand over the bindings the placement now prefers to another member.

The decisions are :class:`~mos_lease.fleet.membership.Membership`'s and the schedule's; this
is the turn's order of calls, written once as a generator like the rest of the turn
(:mod:`mos_lease.keep.turn`), so that the thread and the asyncio supervisor both run
it. Its two calls are :class:`FleetCall`\\ s, which a driver performs the one way for both:
``call.run(coordinator)`` bounded by ``call.timeout``, the coordinator's result or
coroutine being what the driver already knows how to wait for.

    turn --FleetCall(current_holders of every member lease)--> Membership.read
        placement changed: campaigning bindings read again at once
        held bindings preferred to another live member: marked handing (no new grant)
    turn --FleetCall(release_many, correlation id naming the successor)-- per successor
        released: reported as Moved; the successor takes the lease over at the observed
        epoch once its notice (or its next look) shows it released
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from mos_lease.bounded import OVERDUE
from mos_lease.errors import StoreUnavailable
from mos_lease.fleet.membership import handoff_correlation
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.schedule import BATCH
from mos_lease.keep.slots import Slot
from mos_lease.records import LeaseHandle

if TYPE_CHECKING:
    from mos_lease.keep.turn import Core


@attrs.frozen(slots=True, eq=False)
class FleetCall:
    """One store call of the fleet's part of a turn: ``current_holders(identities)`` of the
    member leases, or (``leases`` given) ``release_many(leases, correlation_id=...)`` of a
    hand-off. Answered with its result, the exception it raised, or ``OVERDUE`` after
    ``timeout`` seconds."""

    identities: tuple[LeaseIdentity, ...] = ()
    leases: tuple[LeaseHandle, ...] = ()
    correlation_id: str | None = None
    timeout: float = 0.0

    def run(self, coordinator: Any) -> Any:
        """The coordinator call (its result, or for an asyncio coordinator its coroutine)."""
        if self.leases:
            return coordinator.release_many(list(self.leases),
                                            correlation_id=self.correlation_id)
        return coordinator.current_holders(list(self.identities))


def reading(core: Core) -> bool:
    """Whether the member set is due to be read now (claimed: the next read is a ``look``
    later). Called under the lock."""
    fleet = core.schedule.fleet
    if fleet is None or core.closing:
        return False
    now = core.clock()
    if now < fleet.next_read():
        return False
    fleet.reading(now)
    return True


def members(core: Core, max_call: float) -> Generator[FleetCall, Any, None]:
    """Read the member set, then hand over what it says to, one ``release_many`` per
    successor (and per :data:`BATCH` leases)."""
    fleet = core.schedule.fleet
    assert fleet is not None
    with core.lock:
        started = core.clock()
        limit = min(core.schedule.earliest_deadline() - started, max_call)
    answer = yield FleetCall(identities=fleet.identities, timeout=max(limit, 0.0))
    finished = core.clock()
    views = _answer(answer, len(fleet.identities), "member read")
    with core.lock:
        moves = core.schedule.members_read(views, finished)
    groups: dict[str, list[Slot]] = {}
    for slot, successor in moves:
        groups.setdefault(successor, []).append(slot)
    for successor, slots in groups.items():
        for first in range(0, len(slots), BATCH):
            yield from _hand_off(core, slots[first:first + BATCH], successor, max_call)


def _hand_off(core: Core, slots: list[Slot], successor: str, max_call: float
              ) -> Generator[FleetCall, Any, None]:
    with core.lock:
        started = core.clock()
        leases = tuple(core.schedule.handing(slot) for slot in slots)
        limit = min(core.schedule.earliest_deadline() - started, max_call)
        if core.closing:  # close() releases them, and reports them stopped
            for slot in slots:
                core.schedule.handed(slot, None, successor, started)
            return
    answer = yield FleetCall(leases=leases, correlation_id=handoff_correlation(successor),
                             timeout=max(limit, 0.0))
    finished = core.clock()
    outcomes = _answer(answer, len(slots), f"hand-off to {successor}")
    changes = []
    with core.lock:
        for k, slot in enumerate(slots):
            single = outcomes if isinstance(outcomes, BaseException) else outcomes[k]
            changes += core.schedule.handed(slot, single, successor, finished)
    core.report(changes)


def _answer(answer: Any, expected: int, what: str) -> Sequence[Any] | BaseException:
    """A batched call's answer: its list of ``expected`` results, or an exception."""
    if answer is OVERDUE:
        return StoreUnavailable(f"{what} still running at its time limit; abandoned")
    if isinstance(answer, BaseException):
        return answer
    if not isinstance(answer, list) or len(answer) != expected:
        return StoreUnavailable(f"{what} answered {answer!r:.60} for {expected} leases")
    return answer
