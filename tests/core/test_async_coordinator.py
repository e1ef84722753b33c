"""The asyncio coordinator runs the same flows as the synchronous one: same outcomes, same
reasons, same epochs, same audit trail."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any
from uuid import UUID

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    GrantResult,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    Outcome,
    Reason,
    StoreUnavailable,
)
from mos_lease.clock import ManualClock
from mos_lease.machine import Write
from mos_lease.records import AuditEntry, AuditRecord, Snapshot, WriteOutcome
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.helpers import IDENT, OTHER_IDENT, SCOPES, START, CountingIds, FaultyStore


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def _async_env(policy: Any = None, prefix: int | None = None
               ) -> tuple[ManualClock, InMemoryLeaseStore, AsyncConnectorLeaseCoordinator]:
    clock = ManualClock(START)
    store = InMemoryLeaseStore(clock)
    coordinator = AsyncConnectorLeaseCoordinator(
        AsyncInMemoryLeaseStore(store), AllowAllPolicy() if policy is None else policy,
        id_source=CountingIds(prefix))
    return clock, store, coordinator


def test_main_flow() -> None:
    async def main() -> None:
        clock, store, c = _async_env()
        acquired = await c.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30)
        assert acquired.outcome is Outcome.ACQUIRED and acquired.lease is not None
        lease = acquired.lease
        assert lease.epoch == 1
        clock.advance(10)
        renewed = await c.heartbeat(lease, ttl=30)
        assert renewed.lease is not None
        assert renewed.lease.expires_at == clock.now() + timedelta(seconds=30)
        issued = await c.issue_grant(lease, scopes=["tool:run"], ttl=10)
        assert issued.grant is not None
        calls: list[tuple[tuple[object, ...], dict[str, object]]] = []

        async def adapter(*args: object, **kwargs: object) -> str:
            calls.append((args, kwargs))
            return "done"

        invoked = await c.invoke(issued.grant, adapter, identity=IDENT, scopes=["tool:run"])
        assert invoked.ok and invoked.value == "done"
        assert len(calls) == 1 and calls[0][1] == {}
        assert calls[0][0] == (invoked.context,)
        assert isinstance(invoked.context, ConnectorExecutionContext)
        assert invoked.context.epoch == 1
        taken = await c.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=30, expected_epoch=1)
        assert taken.lease is not None and taken.lease.epoch == 2
        assert taken.lease.lease_id != lease.lease_id
        stale = await c.invoke(issued.grant, adapter, identity=IDENT, scopes=["tool:run"])
        assert stale.reason is Reason.STALE_EPOCH and len(calls) == 1
        assert (await c.heartbeat(lease, ttl=10)).reason is Reason.STALE_EPOCH
        released = await c.release(taken.lease)
        assert released.outcome is Outcome.RELEASED
        assert released.lease is not None and released.lease.epoch == 2
        again = await c.acquire(IDENT, "conn-c", scopes=SCOPES, ttl=10)
        assert (again.reason, again.current_epoch) == (Reason.TAKEOVER_REQUIRED, 2)
        outcomes = [r.entry.outcome for r in store.audit()]
        assert outcomes == [Outcome.ACQUIRED, Outcome.RENEWED, Outcome.GRANT_ISSUED,
                            Outcome.TAKEN_OVER, Outcome.DENIED, Outcome.DENIED,
                            Outcome.RELEASED, Outcome.DENIED]

    _run(main())


def test_denials() -> None:
    async def main() -> None:
        clock, store, c = _async_env()
        lease = (await c.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)).lease
        assert lease is not None
        held = await c.acquire(IDENT, "conn-b", scopes=SCOPES, ttl=10)
        assert (held.reason, held.current_epoch) == (Reason.LEASE_HELD, 1)
        grant = (await c.issue_grant(lease, scopes=["tool:run"], ttl=5)).grant
        assert grant is not None
        forged = attrs.evolve(grant)
        unknown = await c.validate(forged, identity=IDENT, scopes=["tool:run"])
        assert unknown.reason is Reason.GRANT_UNKNOWN
        wrong = await c.validate(grant, identity=OTHER_IDENT, scopes=["tool:run"])
        assert wrong.reason is Reason.BINDING_MISMATCH
        clock.advance(10)
        assert (await c.heartbeat(lease, ttl=10)).reason is Reason.LEASE_EXPIRED
        assert (await c.validate(grant, identity=IDENT, scopes=["tool:run"])).reason is (
            Reason.GRANT_EXPIRED)
        mismatch = await c.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=3)
        assert (mismatch.reason, mismatch.current_epoch) == (Reason.EPOCH_MISMATCH, 1)
        denied = [r.entry for r in store.audit() if r.entry.outcome is Outcome.DENIED]
        assert [e.reason for e in denied] == [
            Reason.LEASE_HELD, Reason.GRANT_UNKNOWN, Reason.BINDING_MISMATCH,
            Reason.LEASE_EXPIRED, Reason.GRANT_EXPIRED, Reason.EPOCH_MISMATCH]

    _run(main())


def test_default_async_policy_denies_everything() -> None:
    async def main() -> None:
        c = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore())
        result = await c.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
        assert result.reason is Reason.POLICY_DENIED
        assert isinstance(c.store, AsyncInMemoryLeaseStore)
        assert c.store.sync.leases() == []

    _run(main())


def test_async_bad_input_raises_invalid_input_and_writes_nothing() -> None:
    async def main() -> None:
        _, store, c = _async_env()
        lease = (await c.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)).lease
        assert lease is not None
        grant = (await c.issue_grant(lease, scopes=[], ttl=5)).grant
        assert grant is not None
        before = list(store.audit()), list(store.leases())
        attempts: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("connector_id", lambda: c.acquire(IDENT, "", scopes=SCOPES, ttl=10)),
            ("scopes", lambda: c.acquire(IDENT, "b", scopes="tool:run", ttl=10)),
            ("ttl", lambda: c.acquire(IDENT, "b", scopes=SCOPES, ttl=301)),
            ("expected_epoch", lambda: c.takeover(IDENT, "b", scopes=SCOPES, ttl=10,
                                                  expected_epoch=0)),
            ("lease.epoch", lambda: c.heartbeat(attrs.evolve(lease, epoch=True), ttl=10)),
            ("lease", lambda: c.release("lease")),  # type: ignore[arg-type]
            ("ttl", lambda: c.issue_grant(lease, scopes=[], ttl=31)),
            ("identity", lambda: c.validate(grant, identity="x",  # type: ignore[arg-type]
                                            scopes=[])),
            ("adapter", lambda: c.invoke(grant, None, identity=IDENT,  # type: ignore[arg-type]
                                         scopes=[])),
        ]
        for field, attempt in attempts:
            with pytest.raises(InvalidInput) as caught:
                await attempt()
            assert caught.value.field == field
        assert (list(store.audit()), list(store.leases())) == before

    _run(main())


class _AsyncFaulty:
    """``FaultyStore`` behind the asyncio store protocol."""

    def __init__(self, inner: FaultyStore) -> None:
        self.inner = inner

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        return self.inner.load(identity)

    async def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        return self.inner.apply(write, entry)

    async def renew_many(self, items: Any) -> list[WriteOutcome]:
        return self.inner.renew_many(items)

    async def record(self, entry: AuditEntry) -> None:
        self.inner.record(entry)

    async def record_many(self, entries: Any) -> None:
        self.inner.record_many(entries)

    async def event_committed(self, event_id: UUID) -> bool:
        return self.inner.event_committed(event_id)


def test_async_validation_fails_closed_and_lost_commits_reconcile() -> None:
    async def main() -> None:
        store = InMemoryLeaseStore(ManualClock(START))
        faulty = FaultyStore(store)
        c = AsyncConnectorLeaseCoordinator(_AsyncFaulty(faulty), AllowAllPolicy(),
                                           id_source=CountingIds())
        faulty.lose_commit = "after"
        acquired = await c.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
        assert acquired.ok and acquired.reconciled and acquired.lease is not None
        grant = (await c.issue_grant(acquired.lease, scopes=[], ttl=5)).grant
        assert grant is not None
        faulty.fail_load = True
        calls: list[ConnectorExecutionContext] = []

        async def adapter(context: ConnectorExecutionContext) -> None:
            calls.append(context)

        result = await c.invoke(grant, adapter, identity=IDENT, scopes=[])
        assert result.reason is Reason.STORE_UNAVAILABLE and calls == []
        with pytest.raises(StoreUnavailable):
            await c.takeover(IDENT, "b", scopes=[], ttl=10, expected_epoch=1)

    _run(main())


# --- the same script through both coordinators --------------------------------------------------

Call = Callable[..., Awaitable[Any]]


def _summary(result: Any) -> Any:
    """A comparable form of a result (grants compare by identity, so use their fields)."""
    if isinstance(result, GrantResult):
        grant = result.grant
        fields = None if grant is None else tuple(
            getattr(grant, f.name) for f in attrs.fields(ExecutionGrant) if f.name != "_mac")
        return ("grant", result.outcome, result.reason, result.correlation_id, fields)
    return result


async def _script(call: Call, clock: ManualClock) -> list[Any]:
    out: list[Any] = []

    async def step(name: str, *args: Any, **kwargs: Any) -> Any:
        result = await call(name, *args, **kwargs)
        out.append((name, _summary(result)))
        return result

    a = (await step("acquire", IDENT, "conn-a", scopes=["tool:run", "tool:read"], ttl=30)).lease
    await step("acquire", IDENT, "conn-b", scopes=SCOPES, ttl=30)
    clock.advance(5)
    await step("heartbeat", a, ttl=20)
    g1 = (await step("issue_grant", a, scopes=["tool:run"], ttl=10)).grant
    await step("issue_grant", a, scopes=["tool:admin"], ttl=10)
    await step("invoke", g1, identity=IDENT, scopes=["tool:run"])
    await step("validate", g1, identity=OTHER_IDENT, scopes=["tool:run"])
    await step("validate", g1, identity=IDENT, scopes=["tool:read"])
    await step("takeover", IDENT, "conn-b", scopes=SCOPES, ttl=30, expected_epoch=2)
    b = (await step("takeover", IDENT, "conn-b", scopes=SCOPES, ttl=30,
                    expected_epoch=1)).lease
    await step("validate", g1, identity=IDENT, scopes=["tool:run"])
    await step("heartbeat", a, ttl=10)
    await step("release", a)
    clock.advance(31)
    await step("heartbeat", b, ttl=10)
    await step("acquire", IDENT, "conn-c", scopes=SCOPES, ttl=10)
    c = (await step("takeover", IDENT, "conn-c", scopes=[], ttl=10, expected_epoch=2)).lease
    await step("release", c)
    await step("release", c)
    await step("takeover", IDENT, "conn-a", scopes=SCOPES, ttl=10, expected_epoch=3)
    await step("heartbeat", LeaseHandle(OTHER_IDENT, "x", UUID(int=1), 1, (), START), ttl=5)
    return out


async def _adapter(context: ConnectorExecutionContext) -> tuple[str, int]:
    return ("ran", context.epoch)


def test_sync_and_async_coordinators_agree_step_for_step() -> None:
    prefix = 0xA5  # the same id sequence for both
    sync_store = InMemoryLeaseStore(ManualClock(START))
    sync_c = ConnectorLeaseCoordinator(sync_store, AllowAllPolicy(),
                                       id_source=CountingIds(prefix))

    async def sync_call(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "invoke":
            return sync_c.invoke(args[0], lambda ctx: ("ran", ctx.epoch), **kwargs)
        return getattr(sync_c, name)(*args, **kwargs)

    clock, async_store, async_c = _async_env(prefix=prefix)

    async def async_call(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "invoke":
            return await async_c.invoke(args[0], _adapter, **kwargs)
        return await getattr(async_c, name)(*args, **kwargs)

    sync_clock = sync_store.clock
    assert isinstance(sync_clock, ManualClock)
    sync_steps = _run(_script(sync_call, sync_clock))
    async_steps = _run(_script(async_call, clock))
    assert len(sync_steps) == 20
    assert sync_steps == async_steps
    sync_audit: list[AuditRecord] = list(sync_store.audit())
    assert sync_audit == list(async_store.audit())
    assert list(sync_store.leases()) == list(async_store.leases())
    # The script really exercised both paths.
    reasons = {step[1].reason for step in sync_steps if hasattr(step[1], "reason")}
    assert {None, Reason.LEASE_HELD, Reason.STALE_EPOCH, Reason.EPOCH_MISMATCH,
            Reason.LEASE_EXPIRED, Reason.LEASE_RELEASED, Reason.TAKEOVER_REQUIRED,
            Reason.BINDING_MISMATCH, Reason.SCOPE_NOT_AUTHORIZED,
            Reason.LEASE_MISSING} <= reasons
