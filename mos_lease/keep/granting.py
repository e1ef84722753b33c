"""A grant for a supervised binding (``Supervisor.issue_grant``), and the grants of each
binding's lease still alive, which a hand-off's drain waits for
(:mod:`mos_lease.keep.handover`).

The rule of a grant for a kept lease is :mod:`mos_lease.held_grant`'s, shared with the
keeper; what is the supervisor's is reading and recording its binding under the lock.
"""

from __future__ import annotations

from collections.abc import Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from mos_lease import held_grant
from mos_lease.identity import GRANT_TTL_CAP, LeaseIdentity
from mos_lease.keep.keeper_calls import IssueGrantCall
from mos_lease.keep.timing import LeaseLoss
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult

if TYPE_CHECKING:
    from mos_lease.keep.turn import Core


def issue_grant(core: Core, identity: LeaseIdentity, scopes: object, ttl: float | timedelta,
                correlation_id: str | None) -> Generator[IssueGrantCall, Any, GrantResult]:
    """Mint a grant for the lease held for ``identity``, or refuse locally (no store call, no
    audit row) when none is held: the one rule of :mod:`mos_lease.held_grant`, the local
    deadline judged before and after the store call, and a refusal that shows the lease
    is gone recorded as the binding's loss at once."""
    granting = _Granting(core, identity, ttl)
    result = yield from held_grant.issue_grant(granting, core.clock, scopes, ttl,
                                               correlation_id)
    if result.grant is not None:
        granting.minted()
    return result


class _Granting:
    """One binding of the supervisor as :class:`~mos_lease.held_grant.GrantSubject` sees
    it: the schedule is read under the lock, and the changes found are reported after."""

    __slots__ = ("core", "identity", "ttl")

    def __init__(self, core: Core, identity: LeaseIdentity, ttl: object) -> None:
        self.core, self.identity = core, identity
        # Seconds the grant may live at most: no longer than the cap (a ttl beyond it, or
        # not a number, is refused by the coordinator, and then nothing is minted).
        seconds = (ttl.total_seconds() if isinstance(ttl, timedelta)
                   else float(ttl) if isinstance(ttl, int | float) else 0.0)
        cap = GRANT_TTL_CAP.total_seconds()
        self.ttl = min(seconds, cap) if seconds > 0 else 0.0  # NaN too: not > 0

    def held_now(self) -> LeaseHandle | None:
        with self.core.lock:
            lease, changes = self.core.schedule.lease(self.identity, self.core.clock())
            if lease is not None:  # a grant of it is in flight from now: a drain waits
                self.minted()
        self.core.report(changes)
        return lease

    def minted(self) -> None:
        """A grant of the binding's lease was asked for, or minted, now: it expires within
        ``ttl`` seconds from now (the store's expiry is its time of minting plus the ttl,
        or sooner), which a hand-off's drain waits for."""
        with self.core.lock:
            slot = self.core.schedule.slots.get(self.identity)
            if slot is not None:
                slot.granted_until = max(slot.granted_until, self.core.clock() + self.ttl)

    def revealed(self, lease: LeaseHandle, loss: LeaseLoss) -> None:
        with self.core.lock:
            changes = self.core.schedule.reveal(self.identity, lease, loss)
        self.core.report(changes)

    def last_loss(self) -> LeaseLoss | None:
        with self.core.lock:
            return self.core.schedule.loss(self.identity)
