"""A gateway's request path on the in-memory store: a grant says when the lease cut it short,
the slow-reply warning names only replies that really came back late, and the asyncio
``invoke`` refuses a synchronous adapter at the call, before anything is read or run."""

from __future__ import annotations

import asyncio
import functools
import logging
from datetime import UTC, datetime, timedelta
from unittest.mock import AsyncMock

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    InvalidInput,
    InvocationResult,
    LeaseIdentity,
    Reason,
)
from mos_lease.adapter import run_adapter_async
from mos_lease.clock import ManualClock
from mos_lease.records import Snapshot
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.helpers import CountingIds

IDENT = LeaseIdentity("acme", "agent-1", "binding-1")
SCOPES = ("tool:run",)
START = datetime(2030, 1, 1, tzinfo=UTC)


# --- a grant capped by its lease ----------------------------------------------------------


@pytest.mark.parametrize(("lease_ttl", "grant_ttl", "capped"), [
    (10, 30, True), (10, 8, True), (10, 7, False), (10, 5, False)])
def test_a_grant_says_whether_the_lease_capped_it_and_when_it_expires(
        lease_ttl: int, grant_ttl: int, capped: bool) -> None:
    clock = ManualClock(START)
    gateway = ConnectorLeaseCoordinator(InMemoryLeaseStore(clock), AllowAllPolicy())
    lease = gateway.acquire(IDENT, "c1", scopes=SCOPES, ttl=lease_ttl).lease
    assert lease is not None
    clock.advance(timedelta(seconds=3))  # part of the lease is used up: 7 s are left
    result = gateway.issue_grant(lease, scopes=SCOPES, ttl=grant_ttl)
    assert result.grant is not None
    assert result.capped_by_lease is capped
    lease_end = START + timedelta(seconds=lease_ttl)
    wanted = min(START + timedelta(seconds=3 + grant_ttl), lease_end)
    assert result.expires_at == result.grant.expires_at == wanted


def test_a_refused_grant_has_no_expiry_and_is_not_capped() -> None:
    gateway = ConnectorLeaseCoordinator(InMemoryLeaseStore(ManualClock(START)),
                                        AllowAllPolicy())
    lease = gateway.acquire(IDENT, "c1", scopes=SCOPES, ttl=10).lease
    assert lease is not None
    assert gateway.release(lease).ok
    result = gateway.issue_grant(lease, scopes=SCOPES, ttl=30)
    assert result.reason is Reason.LEASE_RELEASED
    assert result.expires_at is None and not result.capped_by_lease


# --- the slow-reply warning ---------------------------------------------------------------


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


class QueuedReplies(InMemoryLeaseStore):
    """A store whose ``load`` answers ``queued + wire`` seconds after it was asked: the first
    ``queued`` seconds waiting behind another read (before the store read its clock), the
    last ``wire`` seconds after, as a coalesced read reports them."""

    def __init__(self, clock: ManualClock, mono: FakeMonotonic) -> None:
        super().__init__(clock)
        self.manual = clock
        self.mono = mono
        self.queued = 0.0
        self.wire = 0.0

    def load(self, identity: LeaseIdentity) -> Snapshot:
        self.mono.now += self.queued
        self.manual.advance(self.queued)
        snapshot = super().load(identity)
        self.mono.now += self.wire
        self.manual.advance(self.wire)
        return attrs.evolve(snapshot, queued=self.queued)


@pytest.mark.parametrize(("queued", "wire", "warned"), [
    pytest.param(0.0, 1.5, True, id="late-on-the-wire"),
    pytest.param(0.5, 0.3, False, id="late-only-by-the-queue"),
])
def test_the_slow_reply_warning_names_only_a_reply_that_came_back_late(
        caplog: pytest.LogCaptureFixture, queued: float, wire: float, warned: bool) -> None:
    mono = FakeMonotonic()
    store = QueuedReplies(ManualClock(START), mono)
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy(), id_source=CountingIds(),
                                        monotonic_clock=mono)
    lease = gateway.acquire(IDENT, "c1", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=1).grant
    assert grant is not None
    store.queued, store.wire = queued, wire
    caplog.set_level(logging.INFO, logger="mos_lease")
    result = gateway.validate(grant, identity=IDENT, scopes=SCOPES)
    # Refused either way: the whole wait counts against the validity (fail closed) ...
    assert result.reason is Reason.GRANT_EXPIRED
    # ... but only a reply whose own trip outlived it is reported as late.
    late = [r for r in caplog.records if "past the validity it reported" in r.getMessage()]
    assert bool(late) is warned
    assert all(r.levelno == logging.WARNING for r in late)


# --- the asyncio invoke and a synchronous adapter -----------------------------------------


def _sync_adapter(context: ConnectorExecutionContext) -> int:
    return context.epoch


async def _async_adapter(context: ConnectorExecutionContext) -> int:
    return context.epoch


class _AsyncCallable:
    async def __call__(self, context: ConnectorExecutionContext) -> int:
        return context.epoch


class _SyncCallable:
    def __call__(self, context: ConnectorExecutionContext) -> int:
        return context.epoch


async def _issued(gateway: AsyncConnectorLeaseCoordinator) -> tuple[object, object]:
    lease = (await gateway.acquire(IDENT, "c1", scopes=SCOPES, ttl=60)).lease
    assert lease is not None
    granted = await gateway.issue_grant(lease, scopes=SCOPES, ttl=10)
    assert granted.grant is not None
    return lease, granted.grant


@pytest.mark.parametrize("adapter", [
    _sync_adapter, _SyncCallable(), functools.partial(_sync_adapter), lambda ctx: 1],
    ids=["function", "callable-object", "partial", "lambda"])
def test_async_invoke_refuses_a_synchronous_adapter_before_reading_or_running(
        adapter: object) -> None:
    async def main() -> None:
        store = AsyncInMemoryLeaseStore()
        gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        _lease, grant = await _issued(gateway)
        rows = len(store.sync.audit(IDENT))
        with pytest.raises(InvalidInput, match="async def") as refused:
            await gateway.invoke(grant, adapter, identity=IDENT,  # type: ignore[arg-type]
                                 scopes=SCOPES)
        assert refused.value.field == "adapter"
        assert "ConnectorLeaseCoordinator" in str(refused.value)
        assert len(store.sync.audit(IDENT)) == rows  # nothing read, refused or audited

    asyncio.run(main())


def test_async_invoke_refuses_a_synchronous_adapter_when_the_lease_is_gone_without_running_it(
        ) -> None:
    ran: list[ConnectorExecutionContext] = []

    def adapter(context: ConnectorExecutionContext) -> None:
        ran.append(context)

    async def main() -> None:
        gateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
        lease, grant = await _issued(gateway)
        assert (await gateway.release(lease)).ok  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match="adapter"):
            await gateway.invoke(grant, adapter, identity=IDENT,  # type: ignore[arg-type]
                                 scopes=SCOPES)

    asyncio.run(main())
    assert ran == []


@pytest.mark.parametrize("adapter", [
    _async_adapter, _AsyncCallable(), functools.partial(_async_adapter),
    AsyncMock(return_value=1)],
    ids=["async-function", "async-callable-object", "partial", "async-mock"])
def test_async_invoke_runs_a_coroutine_adapter(adapter: object) -> None:
    async def main() -> None:
        gateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
        _lease, grant = await _issued(gateway)
        result: InvocationResult[int] = await gateway.invoke(
            grant, adapter, identity=IDENT, scopes=SCOPES)  # type: ignore[arg-type]
        assert result.ok and result.value == 1

    asyncio.run(main())


def test_the_sync_invoke_still_takes_any_callable() -> None:
    gateway = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    lease = gateway.acquire(IDENT, "c1", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=10).grant
    assert grant is not None
    assert gateway.invoke(grant, _SyncCallable(), identity=IDENT, scopes=SCOPES).value == 1
    events = {r.entry.event for r in gateway.store.audit(IDENT)}  # type: ignore[attr-defined]
    assert LifecycleEvent.GRANT_VALIDATE not in events


class _SyncShell:
    def execute(self, context: ConnectorExecutionContext, request: str, /) -> str:
        return f"{request} at {context.epoch}"


class _AsyncShell:
    async def execute(self, context: ConnectorExecutionContext, request: str, /) -> str:
        return f"{request} at {context.epoch}"


def test_run_adapter_async_refuses_a_synchronous_adapter_and_runs_an_asyncio_one() -> None:
    async def main() -> None:
        gateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
        _lease, grant = await _issued(gateway)
        with pytest.raises(InvalidInput, match="async def"):
            await run_adapter_async(gateway, grant, _SyncShell(),  # type: ignore[arg-type]
                                    "ls", identity=IDENT, scopes=SCOPES)
        ran = await run_adapter_async(gateway, grant, _AsyncShell(),  # type: ignore[arg-type]
                                      "ls", identity=IDENT, scopes=SCOPES)
        assert ran.value == "ls at 1"

    asyncio.run(main())
