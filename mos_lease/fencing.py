"""Fencing at the effect boundary: the resource-side guard and its pure decision.

The gateway refuses a stale connector before the adapter runs, but a connector validated a
moment before a takeover can still reach a resource after it. A resource closes that gap by
remembering the highest epoch it has admitted and refusing anything lower (the fencing-token
scheme). Equal epochs are admitted: one holder sends many actions under one epoch.

A resource is bound to the identity of the first token it admits. Epochs of one binding are
ordered; epochs of two bindings are unrelated counters, so comparing them would let binding
B's epoch 9 fence binding A's epoch 3 for no reason, or let A's epoch 3 through after B's 2.
A token of another identity is therefore refused outright.

The decision is written once, here, and shared by every guard (in memory, PostgreSQL), so
they cannot drift apart. Refusals are values (:class:`GuardDecision`), not exceptions.
"""

from __future__ import annotations

import enum
from datetime import datetime, timedelta
from typing import Protocol

import attrs

from mos_lease.errors import InvalidInput, MosLeaseError
from mos_lease.identity import LeaseIdentity, check_id
from mos_lease.token import FencingToken
from mos_lease.vocabulary import Reason


class FenceReason(enum.StrEnum):
    """Why a resource guard refused a token. Values are stable, like :class:`Reason`.

    ``stale_epoch`` has the same value as :attr:`Reason.STALE_EPOCH` on purpose: it is the
    same condition seen from the resource.
    """

    STALE_EPOCH = "stale_epoch"
    IDENTITY_MISMATCH = "identity_mismatch"
    TOKEN_EXPIRED = "token_expired"


@attrs.frozen(slots=True)
class ResourceEpoch:
    """What a guard remembers about one resource: whose it is and the highest epoch seen."""

    identity: LeaseIdentity
    highest_epoch: int


@attrs.frozen(slots=True)
class GuardDecision:
    """The answer for one token at one resource.

    ``highest_epoch`` is the highest epoch the resource had admitted once this decision was
    made (``None`` if it has admitted none), so a refused sender learns how far behind it is.
    """

    resource_id: str
    reason: FenceReason | None
    highest_epoch: int | None

    @property
    def ok(self) -> bool:
        return self.reason is None


class FencedEffectRefused(MosLeaseError):
    """A fenced effect was refused; nothing it tried to write was committed.

    Raised (rather than returned) only where a refusal must abort a ``with`` block, as in
    :func:`mos_lease_pg.effects.fenced_transaction`. ``reason`` is a lease
    :class:`~mos_lease.vocabulary.Reason` when the current lease row was checked, or a
    :class:`FenceReason` when a resource guard refused.
    """

    def __init__(self, reason: Reason | FenceReason, message: str = "") -> None:
        super().__init__(f"fenced effect refused: {reason}" + (f" ({message})" if message
                                                                  else ""))
        self.reason = reason


def check_resource_id(value: object) -> str:
    return check_id("resource_id", value)


def check_token(value: object) -> FencingToken:
    if not isinstance(value, FencingToken):
        raise InvalidInput("token", f"must be a FencingToken, not {type(value).__name__}; "
                           "parse text with mos_lease.token.parse_token first")
    return value


def check_expiry_grace(value: object) -> timedelta | None:
    """``None`` (ignore token expiry) or a non-negative allowance for clock disagreement."""
    if value is None:
        return None
    if not isinstance(value, timedelta) or value < timedelta(0):
        raise InvalidInput("expiry_grace", "must be None or a non-negative timedelta")
    return value


def admission_refusal(current: ResourceEpoch | None, token: FencingToken, *,
                      now: datetime | None = None,
                      expiry_grace: timedelta | None = None) -> FenceReason | None:
    """Why ``token`` may not act on a resource whose remembered state is ``current``.

    Expiry is judged only when ``expiry_grace`` is given, against ``now`` (the guard's
    clock): a token is refused once ``expires_at + expiry_grace <= now``. Epoch ordering
    never depends on any clock.

    Every condition here only becomes *more* true over time (the remembered epoch only
    rises, the identity never changes, clocks move forward), so a refusal found at one
    instant still holds at any later one; the PostgreSQL guard relies on this to name a
    refusal from a read made after its atomic statement.
    """
    if current is not None:
        if current.identity != token.identity:
            return FenceReason.IDENTITY_MISMATCH
        if token.epoch < current.highest_epoch:
            return FenceReason.STALE_EPOCH
    if expiry_grace is not None:
        if now is None:
            raise InvalidInput("now", "is needed when expiry_grace is set")
        if token.expires_at + expiry_grace <= now:
            return FenceReason.TOKEN_EXPIRED
    return None


def admit(current: ResourceEpoch | None, token: FencingToken, resource_id: str, *,
          now: datetime | None = None, expiry_grace: timedelta | None = None,
          ) -> tuple[ResourceEpoch | None, GuardDecision]:
    """The remembered state after ``token`` is presented, and the decision to report."""
    reason = admission_refusal(current, token, now=now, expiry_grace=expiry_grace)
    if reason is not None:
        return current, GuardDecision(resource_id, reason,
                                      None if current is None else current.highest_epoch)
    after = ResourceEpoch(token.identity, token.epoch if current is None
                          else max(current.highest_epoch, token.epoch))
    return after, GuardDecision(resource_id, None, after.highest_epoch)


class ResourceGuard(Protocol):
    """A resource-side fence: keeps the highest epoch admitted per resource.

    ``admit`` must decide and record in one atomic step: two concurrent callers with epochs
    5 and 6 must never both be admitted with 5 admitted last. A refusal changes nothing.
    """

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision: ...


class AsyncResourceGuard(Protocol):
    """The asyncio twin of :class:`ResourceGuard`, with the same contract."""

    async def admit(self, resource_id: str, token: FencingToken) -> GuardDecision: ...
