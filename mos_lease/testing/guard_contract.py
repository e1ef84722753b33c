"""The contract every :class:`~mos_lease.fencing.ResourceGuard` must meet.

A guard of your own (on a key-value store, another SQL database) is checked from the
outside, through ``admit`` alone: the first token binds a resource to its identity; equal
and higher epochs are admitted and the highest is what the guard reports; lower epochs and
other identities are refused; an expired token is refused unless the guard was built with
``ignore_expiry=True``; and neither a refusal nor bad input records anything (a later token
proves it, since a recorded epoch would fence it).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol
from uuid import uuid4

from mos_lease.errors import InvalidInput
from mos_lease.fencing import FenceReason, GuardDecision, ResourceGuard
from mos_lease.identity import LeaseIdentity
from mos_lease.token import FencingToken


class GuardFactory(Protocol):
    """Makes a fresh guard object on the store under test (guards may share the store)."""

    def __call__(self, *, ignore_expiry: bool) -> ResourceGuard: ...


def _utc_now() -> datetime:
    return datetime.now(UTC)


def run_guard_contract(make_guard: GuardFactory, *,
                       clock: Callable[[], datetime] = _utc_now, durable: bool = True) -> None:
    """Raise ``AssertionError`` at the first promise the guard breaks.

    ``make_guard(ignore_expiry=...)`` builds a guard with no ``expiry_grace``; ``clock``
    is roughly the guard's clock (within minutes): tokens the contract means to be live
    expire an hour after it, expired ones a minute before it. Resource ids and identities
    are fresh per run, so guards on a shared durable store may be checked repeatedly.
    ``durable=True`` (the default) also checks that a second guard object made by
    ``make_guard`` sees what the first recorded; pass ``False`` for a guard whose memory is
    its own object (the in-memory guard).
    """
    run = uuid4().hex[:12]
    owner = LeaseIdentity(f"guard-{run}", "agent", "binding-1")
    other = LeaseIdentity(f"guard-{run}", "agent", "binding-2")
    live, dead = clock() + timedelta(hours=1), clock() - timedelta(minutes=1)

    def token(epoch: int, identity: LeaseIdentity = owner,
              expires_at: datetime = live) -> FencingToken:
        return FencingToken(identity, "connector", uuid4(), epoch, expires_at)

    def expect(guard: ResourceGuard, resource: str, presented: FencingToken,
               reason: FenceReason | None, highest: int | None) -> None:
        decision = guard.admit(resource, presented)
        want = GuardDecision(resource, reason, highest)
        assert decision == want, f"epoch {presented.epoch} at {resource}: {decision}, " \
                                 f"contract {want}"

    guard = make_guard(ignore_expiry=False)
    first, second, third = (f"resource-{run}-{i}" for i in range(3))
    expect(guard, first, token(3), None, 3)  # the first token binds the resource
    expect(guard, first, token(3), None, 3)  # one holder, many actions
    expect(guard, first, token(2), FenceReason.STALE_EPOCH, 3)
    expect(guard, first, token(5), None, 5)
    expect(guard, first, token(4), FenceReason.STALE_EPOCH, 5)
    expect(guard, first, token(9, other), FenceReason.IDENTITY_MISMATCH, 5)
    expect(guard, first, token(9, expires_at=dead), FenceReason.TOKEN_EXPIRED, 5)
    # Neither refusal above recorded its epoch 9: epoch 6 is still admitted.
    expect(guard, first, token(6), None, 6)
    # Resources are independent; a refused first token binds nothing.
    expect(guard, second, token(1, other, dead), FenceReason.TOKEN_EXPIRED, None)
    expect(guard, second, token(1), None, 1)
    if durable:  # a fresh guard object on the same store sees what the first recorded
        expect(make_guard(ignore_expiry=False), first, token(5), FenceReason.STALE_EPOCH, 6)

    # Bad input raises InvalidInput and records nothing.
    imitation = _Imitation(owner, "connector", uuid4(), 99, live)
    for resource, presented in (("", token(7)), (" padded", token(7)), ("x" * 129, token(7)),
                                (7, token(7)), (None, token(7)), (first, imitation),
                                (first, None)):
        try:
            guard.admit(resource, presented)  # type: ignore[arg-type]
        except InvalidInput:
            pass
        else:
            raise AssertionError(f"admit({resource!r}, {presented!r}) did not raise "
                                 "InvalidInput")
    expect(guard, first, token(6), None, 6)

    # ignore_expiry=True: epochs are the only fence.
    lax = make_guard(ignore_expiry=True)
    expect(lax, third, token(2, expires_at=dead), None, 2)
    expect(lax, third, token(1, expires_at=dead), FenceReason.STALE_EPOCH, 2)


class _Imitation:
    """Something with a token's fields that is not a :class:`FencingToken`."""

    def __init__(self, *fields: Any) -> None:
        self.identity, self.connector_id, self.lease_id, self.epoch, self.expires_at = fields

    def __repr__(self) -> str:
        return f"<imitation token at epoch {self.epoch}>"


__all__ = ["GuardFactory", "run_guard_contract"]
