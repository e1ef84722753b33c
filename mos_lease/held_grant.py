"""A grant for a lease kept alive, written once for the keeper and the supervisor: the local
deadline is judged before and after the store call, so no grant is handed out once the
deadline has passed, whatever the store says or however long it took; a refusal that shows
the lease is gone is recorded as the loss at once; and with no lease held the grant is
refused locally (no store call, no audit row), naming the loss's reason.

:func:`issue_grant` is a generator of one step (:class:`~mos_lease.keep.keeper_calls.
IssueGrantCall`), driven as the keeper's and the supervisor's turns are; what it asks of the
one who keeps the lease is a :class:`GrantSubject`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any, Protocol

from mos_lease.identity import check_correlation_id
from mos_lease.keep.keeper_calls import IssueGrantCall
from mos_lease.keep.timing import LeaseLoss, LossCause, grant_loss, local_refusal
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult
from mos_lease.vocabulary import Reason

log = logging.getLogger("mos_lease.keeper")


class GrantSubject(Protocol):
    """The one who keeps a lease, as :func:`issue_grant` sees it."""

    def held_now(self) -> LeaseHandle | None:
        """The lease held now, its local deadline judged on the spot (a passed deadline is
        recorded, and reported, as the loss); ``None`` if none is held."""

    def revealed(self, lease: LeaseHandle, loss: LeaseLoss) -> None:
        """Record ``loss`` of ``lease`` that a grant's refusal showed (unless another lease
        is held by now, or the loss was recorded already)."""

    def last_loss(self) -> LeaseLoss | None:
        """The loss recorded last, if no lease is held (``None`` if none was ever held)."""


def correlation(correlation_id: str | None) -> str:
    """The correlation id given (checked), or a new one."""
    given = check_correlation_id("correlation_id", correlation_id)
    return given if given is not None else uuid.uuid4().hex


def issue_grant(subject: GrantSubject, clock: Callable[[], float], scopes: object,
                ttl: float | timedelta, correlation_id: str | None
                ) -> Generator[IssueGrantCall, Any, GrantResult]:
    """Mint a grant for the lease ``subject`` holds, or refuse locally when none is held
    (see the module's docstring). The correlation id is checked before anything else."""
    correlation_id = correlation(correlation_id)
    lease = subject.held_now()
    if lease is not None:
        result: GrantResult = yield IssueGrantCall(lease, scopes, ttl, correlation_id)
        revealed = grant_loss(result, clock())
        if revealed is not None:
            subject.revealed(lease, revealed)
        still = subject.held_now()
        if still is not None and still.lease_id == lease.lease_id:
            return result
    loss = subject.last_loss()
    if loss is None:  # never held, or held anew meanwhile: not this grant's lease
        loss = LeaseLoss(LossCause.DENIED, Reason.LEASE_MISSING, clock())
    log.info("mos_lease: grant refused locally: no lease held (%s, reason=%s)", loss.cause,
             loss.reason)
    return local_refusal(loss, correlation_id)
