"""Running the conformance kit against asyncio stores and guards.

The contract, the stateful specification and the guard contract are written once, against
the synchronous ports. :class:`EventLoopThread` runs one private event loop on a daemon
thread and presents an async harness (or guard) as a synchronous one whose every call is a
coroutine run to completion on that loop, so the same checks drive an async-only store.
Objects bound to a loop (an ``AsyncConnection``, a pool) must be made and used on this
one: build them inside the factories, or with :meth:`EventLoopThread.run`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any, TypeVar
from uuid import UUID

from mos_lease.fencing import AsyncResourceGuard, GuardDecision
from mos_lease.identity import LeaseIdentity
from mos_lease.machine import Renew, Write
from mos_lease.ports import BATCH_METHODS
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome
from mos_lease.testing.guard_contract import GuardFactory
from mos_lease.testing.harness import AsyncInspectableStore, AsyncStoreHarness, StoreHarness
from mos_lease.token import FencingToken

T = TypeVar("T")


class EventLoopThread:
    """One private asyncio event loop on a daemon thread, driven from synchronous code.

    Use it as a context manager, or keep one for a whole test module (the thread is a
    daemon and exits with the process).
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="mos-lease-kit-loop", daemon=True)
        self._thread.start()

    def run(self, awaitable: Awaitable[T]) -> T:
        """Run ``awaitable`` on the loop and return its result (or raise its exception)."""
        if threading.current_thread() is self._thread:
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never to be awaited: say so quietly, not with a warning
            raise RuntimeError("EventLoopThread.run called from its own loop: it would block")

        async def wrapped() -> T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wrapped(), self._loop).result()

    def harness_factory(self, factory: Callable[[], AsyncStoreHarness]
                        ) -> Callable[[], StoreHarness]:
        """A factory of synchronous harnesses for :func:`~mos_lease.testing.run_store_contract`
        and :func:`~mos_lease.testing.make_lease_machine`; ``factory`` runs on the loop."""
        return lambda: DrivenHarness(self.run(_made(factory)), self)

    def guard_factory(self, factory: Callable[..., AsyncResourceGuard]) -> GuardFactory:
        """As :meth:`harness_factory`, for :func:`~mos_lease.testing.run_guard_contract`."""
        return lambda **options: DrivenGuard(self.run(_made(factory, **options)), self)

    def close(self) -> None:
        """Stop the loop, join its thread and close the loop (``with`` does this on
        leaving)."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> EventLoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _made(factory: Callable[..., T], **options: Any) -> T:
    # Made on the loop, so that whatever the factory binds to "the running loop" is this one.
    return factory(**options)


class DrivenStore:
    """An async store presented as a synchronous :class:`~mos_lease.testing.InspectableStore`."""

    def __init__(self, store: AsyncInspectableStore, loop: EventLoopThread) -> None:
        self.store = store
        self._run = loop.run
        # The batch operations are optional (mos_lease.ports.AsyncBatchLeaseStore): driven
        # only where the store has them, so the kit checks them only there.
        for name in BATCH_METHODS:
            method = getattr(store, name, None)
            if method is not None:
                setattr(self, name, functools.partial(self._drive, method))

    def _drive(self, method: Callable[..., Coroutine[Any, Any, T]], *args: object) -> T:
        return self._run(method(*args))

    def load(self, identity: LeaseIdentity) -> Snapshot:
        return self._run(self.store.load(identity))

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        return self._run(self.store.apply(write, entry))

    def renew_many(self, renewals: Sequence[tuple[Renew, AuditEntry]]
                   ) -> Sequence[WriteOutcome]:
        return self._run(self.store.renew_many(renewals))

    def record(self, entry: AuditEntry) -> None:
        self._run(self.store.record(entry))

    def event_committed(self, event_id: UUID) -> bool:
        return self._run(self.store.event_committed(event_id))

    def leases(self, tenant_id: str | None = None) -> Sequence[LeaseRow]:
        return self._run(self.store.leases(tenant_id))

    def audit(self, identity: LeaseIdentity | None = None, *, after_seq: int = 0,
              limit: int = 1000) -> Sequence[AuditRecord]:
        return self._run(self.store.audit(identity, after_seq=after_seq, limit=limit))


class DrivenHarness:
    """An :class:`~mos_lease.testing.AsyncStoreHarness` as a synchronous one."""

    def __init__(self, harness: AsyncStoreHarness, loop: EventLoopThread) -> None:
        self.harness = harness
        self._loop = loop
        self._store = DrivenStore(harness.store, loop)

    @property
    def store(self) -> DrivenStore:
        return self._store

    def advance(self, by: timedelta) -> None:
        self._loop.run(self.harness.advance(by))


class DrivenGuard:
    """An :class:`~mos_lease.fencing.AsyncResourceGuard` as a synchronous one."""

    def __init__(self, guard: AsyncResourceGuard, loop: EventLoopThread) -> None:
        self.guard = guard
        self._loop = loop

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        return self._loop.run(self.guard.admit(resource_id, token))


__all__ = ["DrivenGuard", "DrivenHarness", "DrivenStore", "EventLoopThread"]
