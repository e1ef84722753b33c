"""Fenced effects in one process: the lease check and the effect under the store's lock.

The in-memory counterpart of :func:`mos_lease_pg.effects.fenced_transaction`, for a gateway
whose leases live in an :class:`~mos_lease_memory.InMemoryLeaseStore` (and for tests)::

    fenced_effect(store, context, lambda: outbox.append(body), scopes=["outbox:write"])

The store's lock is held from the read of the lease row, through the check (everything
gateway validation checks: :func:`mos_lease.fencing.effect_refusal`, judged by the store's
clock read under the lock), to the end of the effect. A heartbeat, release or takeover takes
the same lock, so either the effect runs first (it belongs to the old epoch, before any
successor starts) or the lease write does and the effect is refused without running.

The effect is a plain callable, run to completion under the lock, rather than a ``with``
block: an asyncio block that awaited while holding a thread lock would stall the event loop
that has to run the lease's own heartbeats. Keep it short; it holds up every store call.

``valid_until`` is as for the PostgreSQL helper (:class:`~mos_lease.fencing.ValidUntil`):
``ValidUntil.LEASE`` judges the lease row alone, for a tool that outlives its grant.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TypeVar

from mos_lease.context import ConnectorExecutionContext
from mos_lease.errors import InvalidInput
from mos_lease.fencing import FenceCheck, ValidUntil, fence_check
from mos_lease.identity import LeaseIdentity
from mos_lease.records import Snapshot
from mos_lease.token import FencingToken
from mos_lease_memory.store import AsyncInMemoryLeaseStore, InMemoryLeaseStore

T = TypeVar("T")


def _checked_effect(effect: Callable[[], T]) -> Callable[[], T]:
    if not callable(effect):
        raise InvalidInput("effect", f"must be callable, not {type(effect).__name__}")
    if inspect.iscoroutinefunction(effect):
        # Its body would run after the lock is released, unfenced.
        raise InvalidInput("effect", "must be a plain callable, not a coroutine function: "
                           "it runs to completion under the store's lock")
    return effect


def _judged(check: FenceCheck, effect: Callable[[], T]) -> Callable[[Snapshot], T]:
    def under_lock(snapshot: Snapshot) -> T:
        reason = check.refusal(snapshot.row, snapshot.now)
        if reason is not None:
            raise check.refused(reason)
        return effect()
    return under_lock


def fenced_effect(store: InMemoryLeaseStore, context: ConnectorExecutionContext | FencingToken,
                  effect: Callable[[], T], *, scopes: Iterable[str],
                  identity: LeaseIdentity | None = None,
                  valid_until: ValidUntil = ValidUntil.CONTEXT) -> T:
    """Run ``effect()`` and return its value only if ``context`` (a context or a token)
    passes every check gateway validation makes against ``store``'s current lease row,
    holding the store's lock from the read to the effect's end.

    ``scopes`` (required; ``()`` for none), ``identity`` and ``valid_until`` are as for
    :func:`mos_lease_pg.effects.fenced_transaction`. Raises
    :class:`~mos_lease.fencing.FencedEffectRefused` with a lease
    :class:`~mos_lease.vocabulary.Reason` (``effect`` not called) if a check fails, and
    :class:`~mos_lease.InvalidInput` for malformed arguments (nothing read or run).
    Whatever ``effect`` raises reaches the caller unchanged.
    """
    if not isinstance(store, InMemoryLeaseStore):
        raise InvalidInput("store", f"must be an InMemoryLeaseStore, not {type(store).__name__}")
    check = fence_check(context, scopes, identity, valid_until)
    return store.holding(check.token.identity, _judged(check, _checked_effect(effect)))


async def fenced_effect_async(store: AsyncInMemoryLeaseStore,
                              context: ConnectorExecutionContext | FencingToken,
                              effect: Callable[[], T], *, scopes: Iterable[str],
                              identity: LeaseIdentity | None = None,
                              valid_until: ValidUntil = ValidUntil.CONTEXT) -> T:
    """The asyncio twin of :func:`fenced_effect`, for an
    :class:`~mos_lease_memory.AsyncInMemoryLeaseStore`. ``effect`` is a plain callable
    (run under the lock without yielding to the event loop), not a coroutine function."""
    if not isinstance(store, AsyncInMemoryLeaseStore):
        raise InvalidInput("store",
                           f"must be an AsyncInMemoryLeaseStore, not {type(store).__name__}")
    return fenced_effect(store.sync, context, effect, scopes=scopes, identity=identity,
                         valid_until=valid_until)
