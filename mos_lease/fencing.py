"""Fencing at the effect boundary: the resource-side guard and its pure decision.

The gateway refuses a stale connector before the adapter runs, but a connector validated a
moment before a takeover can still reach a resource after it. A resource closes that gap by
remembering the highest epoch it has admitted and refusing anything lower (the fencing-token
scheme). Equal epochs are admitted: one holder sends many actions under one epoch.

A resource is bound to the identity of the first token it admits. Epochs of one binding are
ordered; epochs of two bindings are unrelated counters, so comparing them would let binding
B's epoch 9 fence binding A's epoch 3 for no reason, or let A's epoch 3 through after B's 2.
A token of another identity is therefore refused outright.

A token whose own ``expires_at`` has passed is refused too (``token_expired``), by default
with no grace: the gateway promised validity only until then, and a boundary that admitted
it later would accept what gateway validation already refuses. The guard's clock judges it
(the database clock for the PostgreSQL guard). ``ignore_expiry=True`` turns this off, for a
boundary whose clock cannot be trusted at all; epochs are then the only fence.

The decision is written once, here, and shared by every guard (in memory, PostgreSQL), so
they cannot drift apart. Refusals are values (:class:`GuardDecision`), not exceptions.

For a guard of your own (``docs/writing-a-store.md``), the stable surface is ``__all__``:
the decision (:func:`admission_refusal`, :func:`admit`), the input checks
(:func:`check_resource_id`, :func:`check_token`), the expiry options
(:func:`judged_grace`, :func:`check_expiry_grace`, :data:`NO_GRACE`) and the types
(:class:`ResourceEpoch`, :class:`GuardDecision`, :class:`FenceReason`, the protocols).
The shipped guards are built from exactly these.

:func:`effect_refusal` is the check for an effect fenced by the lease row itself
(:mod:`mos_lease_pg.effects`, :mod:`mos_lease_memory.effects`): everything gateway
validation checks, for a context or a token. :func:`fence_check` validates such an effect's
arguments. Its ``valid_until`` (:class:`ValidUntil`) says which expiry ends the fence: the
context's own (the default), or, explicitly opted into for a tool that runs longer than a
grant, the lease's alone (``docs/adapters.md``, "Tools that outlive a grant").
"""

from __future__ import annotations

import enum
from datetime import datetime, timedelta
from typing import Final, Protocol

import attrs

from mos_lease.context import ConnectorExecutionContext
from mos_lease.errors import InvalidInput, MosLeaseError
from mos_lease.identity import LeaseIdentity, Scopes, check_id, check_identity, normalize_scopes
from mos_lease.machine import clock_refusal, holder_refusal, identity_refusal
from mos_lease.records import LeaseRow
from mos_lease.token import FencingToken
from mos_lease.vocabulary import Reason

NO_GRACE: Final = timedelta(0)
"""The default ``expiry_grace``: a token is refused from the instant its ``expires_at``."""


class FenceReason(enum.StrEnum):
    """Why a resource guard refused a token. Values are stable, like :class:`Reason`.

    ``stale_epoch`` has the same value as :attr:`Reason.STALE_EPOCH` on purpose: it is the
    same condition seen from the resource.
    """

    STALE_EPOCH = "stale_epoch"
    IDENTITY_MISMATCH = "identity_mismatch"
    TOKEN_EXPIRED = "token_expired"


class ValidUntil(enum.StrEnum):
    """Which expiry ends a fenced effect's fence (``valid_until=``). Stable values.

    ``context`` (the default): the fence's own ``expires_at``, the earlier of its grant's
    and its lease's expiry, as gateway validation judges the grant: past it the effect is
    refused ``grant_expired`` even while the lease is held. ``lease``: the fence's
    ``expires_at`` is not judged; the current lease row alone decides (same epoch, lease
    UUID and connector, not released, not expired), so a tool may keep writing for as long
    as its lease is held and renewed, and its first effect after a takeover, a release or
    the lease's expiry is refused. Only for effects judged against the lease row in their
    own transaction; a resource guard, which cannot see the row, has no such mode.
    """

    CONTEXT = "context"
    LEASE = "lease"


def check_valid_until(value: object) -> ValidUntil:
    """``value`` as a :class:`ValidUntil` (a member or its text: ``"context"``,
    ``"lease"``), else :class:`~mos_lease.InvalidInput`."""
    if isinstance(value, str):
        try:
            return ValidUntil(value)
        except ValueError:
            # The text only, cut short: an oversized argument is not echoed whole.
            got = repr(value[:40])
    else:
        got = type(value).__name__
    raise InvalidInput("valid_until", 'must be ValidUntil.CONTEXT or ValidUntil.LEASE '
                       f'("context" or "lease"), not {got}')


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
        """Whether the token was admitted."""
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
    """``value`` as a resource id (the rules of every id: 1 to 128 characters, no control
    characters, no surrounding whitespace), else :class:`~mos_lease.InvalidInput`. Check
    before anything is read or written."""
    return check_id("resource_id", value)


def check_token(value: object) -> FencingToken:
    """``value`` if it is a :class:`~mos_lease.FencingToken`, else
    :class:`~mos_lease.InvalidInput`: text must go through
    :func:`~mos_lease.token.parse_token` (and its signature check) first, and an object that
    only looks like a token is refused."""
    if not isinstance(value, FencingToken):
        raise InvalidInput("token", f"must be a FencingToken, not {type(value).__name__}; "
                           "parse text with mos_lease.token.parse_token first")
    return value


def check_expiry_grace(value: object) -> timedelta:
    """A non-negative allowance for clock disagreement (:data:`NO_GRACE` by default)."""
    if value is None:
        # ``None`` used to mean "expiry off"; refuse it loudly rather than silently
        # reinterpret it, and name the explicit switch.
        raise InvalidInput("expiry_grace", "must be a non-negative timedelta; to admit "
                           "expired tokens pass ignore_expiry=True")
    if not isinstance(value, timedelta) or value < timedelta(0):
        raise InvalidInput("expiry_grace", "must be a non-negative timedelta")
    return value


def judged_grace(expiry_grace: object, ignore_expiry: object) -> timedelta | None:
    """A guard's constructor options as the ``expiry_grace`` the decision takes: ``None``
    (expiry not judged) only when ``ignore_expiry`` is ``True``."""
    if not isinstance(ignore_expiry, bool):
        raise InvalidInput("ignore_expiry", f"must be a bool, not {type(ignore_expiry).__name__}")
    grace = check_expiry_grace(expiry_grace)
    return None if ignore_expiry else grace


def admission_refusal(current: ResourceEpoch | None, token: FencingToken, *,
                      now: datetime | None = None,
                      expiry_grace: timedelta | None = NO_GRACE) -> FenceReason | None:
    """Why ``token`` may not act on a resource whose remembered state is ``current``.

    Expiry is judged against ``now`` (the guard's clock, required unless expiry is off): a
    token is refused once ``expires_at + expiry_grace <= now``. ``expiry_grace=None`` means
    expiry is not judged (a guard built with ``ignore_expiry=True``). Epoch ordering never
    depends on any clock.

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
            raise InvalidInput("now", "is needed unless expiry is ignored (expiry_grace=None)")
        if token.expires_at + expiry_grace <= now:
            return FenceReason.TOKEN_EXPIRED
    return None


def admit(current: ResourceEpoch | None, token: FencingToken, resource_id: str, *,
          now: datetime | None = None, expiry_grace: timedelta | None = NO_GRACE,
          ) -> tuple[ResourceEpoch | None, GuardDecision]:
    """The remembered state after ``token`` is presented, and the decision to report.

    :func:`admission_refusal` plus the bookkeeping: on a refusal the state is ``current``
    unchanged (store nothing); on admission it is the state to store, the highest epoch
    so far. Read ``current`` and store the result in one atomic step (a transaction that
    locks the resource's row), reading ``now`` once that lock is held.
    """
    reason = admission_refusal(current, token, now=now, expiry_grace=expiry_grace)
    if reason is not None:
        return current, GuardDecision(resource_id, reason,
                                      None if current is None else current.highest_epoch)
    after = ResourceEpoch(token.identity, token.epoch if current is None
                          else max(current.highest_epoch, token.epoch))
    return after, GuardDecision(resource_id, None, after.highest_epoch)


def effect_refusal(row: LeaseRow | None, now: datetime, fence: FencingToken, *,
                   needed: Scopes, granted: Scopes | None,
                   valid_until: ValidUntil = ValidUntil.CONTEXT) -> Reason | None:
    """Why an effect fenced by ``fence`` may not commit against the current lease ``row``,
    judged at ``now`` (the lease store's clock, read once the row is locked).

    The same conditions as gateway validation (:func:`mos_lease.machine.grant_refusal`),
    in this order:

    * the lease row, as :func:`~mos_lease.machine.holder_refusal` judges it (missing, stale
      or mismatched epoch, replaced, released, expired): facts about the lease, named first;
    * the clock: ``now`` earlier than the row's latest stamp means the store's clock stepped
      back since the row was written (:func:`~mos_lease.machine.clock_refusal`), and the
      lease's expiry cannot be judged at such a time: ``clock_behind``;
    * the fence's own expiry: a context is valid only until its ``expires_at`` (the earlier
      of grant and lease), and a token made from it carries the same instant. Past it the
      effect is refused ``grant_expired``, the reason validation gives the same grant, even
      while the lease itself is still active. With ``valid_until=ValidUntil.LEASE`` this
      check is skipped: the lease row's own state (above) ends the fence;
    * scopes: every scope in ``needed`` must be allowed by the current lease and, for a
      context, be one of the context's effective scopes (``granted``). A token carries no
      scopes (``granted`` is ``None``): its effect is checked against the lease only.
      Otherwise ``scope_not_authorized``.

    The fence's identity is the row's (the row is looked up by it), so identity needs no
    comparison here; the identity an effect belongs to, where the caller knows it, is
    checked before with :func:`mos_lease.machine.identity_refusal`, as validation does.
    """
    reason = (holder_refusal(row, now, fence.connector_id, fence.lease_id, fence.epoch)
              or clock_refusal(row, now))
    if reason is not None:
        return reason
    assert row is not None
    if valid_until is ValidUntil.CONTEXT and fence.expires_at <= now:
        return Reason.GRANT_EXPIRED
    wanted = set(needed)
    if not wanted.issubset(row.scopes) or (granted is not None
                                           and not wanted.issubset(granted)):
        return Reason.SCOPE_NOT_AUTHORIZED
    return None


@attrs.frozen(slots=True)
class FenceCheck:
    """A fence and an effect's needs, validated: what :func:`effect_refusal` is given."""

    token: FencingToken  # the fence's lease fields, checked as a token's are
    granted: Scopes | None  # the context's scopes; ``None`` for a token, which has none
    needed: Scopes
    valid_until: ValidUntil = ValidUntil.CONTEXT

    def refusal(self, row: LeaseRow | None, now: datetime) -> Reason | None:
        """:func:`effect_refusal` of this check against ``row`` at store time ``now``."""
        return effect_refusal(row, now, self.token, needed=self.needed, granted=self.granted,
                              valid_until=self.valid_until)

    def refused(self, reason: Reason) -> FencedEffectRefused:
        """The exception that reports ``reason`` for this fence."""
        return FencedEffectRefused(reason, f"{self.token.identity} epoch {self.token.epoch}")


def fence_check(fence: object, scopes: object, identity: LeaseIdentity | None = None,
                valid_until: object = ValidUntil.CONTEXT) -> FenceCheck:
    """Validate the arguments of a fenced effect before anything is read or written
    (:class:`~mos_lease.InvalidInput` for a fence that is neither a context nor a token,
    malformed scopes or an unknown ``valid_until``); refuse at once an ``identity`` the
    fence does not belong to (:class:`FencedEffectRefused` with the reason validation
    gives: ``tenant_mismatch``, ...)."""
    if isinstance(fence, FencingToken):
        token, granted = fence, None
    elif isinstance(fence, ConnectorExecutionContext):
        # Rebuilt as a token: a hand-built context gets the token's field checks (a naive
        # expiry, a non-UUID lease id), so nothing malformed reaches a comparison.
        token = FencingToken.from_context(fence)
        granted = normalize_scopes("context.scopes", fence.scopes)
    else:
        raise InvalidInput("context", "must be a ConnectorExecutionContext or FencingToken, "
                           f"not {type(fence).__name__}")
    needed = normalize_scopes("scopes", scopes)
    until = check_valid_until(valid_until)
    if identity is not None:
        reason = identity_refusal(token.identity, check_identity("identity", identity))
        if reason is not None:
            raise FencedEffectRefused(reason, f"{token.identity} is not {identity}")
    return FenceCheck(token, granted, needed, until)


class ResourceGuard(Protocol):
    """A resource-side fence: keeps the highest epoch admitted per resource.

    ``admit`` must decide and record in one atomic step: two concurrent callers with epochs
    5 and 6 must never both be admitted with 5 admitted last. A refusal changes nothing.
    """

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        """Admit ``token`` for ``resource_id`` or refuse it (``stale_epoch``,
        ``identity_mismatch``, ``token_expired``), deciding and recording the highest
        epoch in one atomic step."""


class AsyncResourceGuard(Protocol):
    """The asyncio twin of :class:`ResourceGuard`, with the same contract."""

    async def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        """As :meth:`ResourceGuard.admit`."""


__all__ = [
    "NO_GRACE",
    "AsyncResourceGuard",
    "FenceCheck",
    "FenceReason",
    "FencedEffectRefused",
    "GuardDecision",
    "ResourceEpoch",
    "ResourceGuard",
    "ValidUntil",
    "admission_refusal",
    "admit",
    "check_expiry_grace",
    "check_resource_id",
    "check_token",
    "check_valid_until",
    "effect_refusal",
    "fence_check",
    "judged_grace",
]
