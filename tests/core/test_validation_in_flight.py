"""Validation refuses a reply that arrived after the validity it reported had run out.

The store reports ``now`` with the row; the context is valid until ``min(lease expiry, grant
expiry)``, which is ``validity = expiry - now`` after the store read its clock. The read
happened somewhere between sending the request and receiving the reply, so once the round trip
took at least ``validity`` the context may already be dead when the caller gets it. The
coordinator measures the round trip on its monotonic clock and refuses (``grant_expired`` or
``lease_expired``, whichever ran out first) rather than run an adapter on it.

Deterministic here: a store wrapper whose ``load`` advances a fake monotonic clock (and the
store's own clock) by the reply's delay after the store has read its time.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    Outcome,
    Reason,
)
from mos_lease.clock import ManualClock
from mos_lease.records import Snapshot
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.helpers import CountingIds

IDENT = LeaseIdentity("acme", "agent-1", "binding-1")
SCOPES = ("tool:run",)
START = datetime(2030, 1, 1, tzinfo=UTC)


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


class SlowReplies(InMemoryLeaseStore):
    """An in-memory store whose ``load`` replies ``delay`` seconds after the store read its
    clock: both the gateway's monotonic clock and the store's clock move on by ``delay``."""

    def __init__(self, clock: ManualClock, mono: FakeMonotonic) -> None:
        super().__init__(clock)
        self.manual = clock
        self.mono = mono
        self.delay = 0.0

    def load(self, identity: LeaseIdentity) -> Snapshot:
        snapshot = super().load(identity)
        self.mono.now += self.delay
        self.manual.advance(self.delay)
        return snapshot


def _rig() -> tuple[SlowReplies, ConnectorLeaseCoordinator]:
    mono = FakeMonotonic()
    store = SlowReplies(ManualClock(START), mono)
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy(), id_source=CountingIds(),
                                        monotonic_clock=mono)
    return store, gateway


# (lease ttl, grant ttl, reply delay, expected reason): the grant is valid for 10 s and the
# lease for 30 s, or the other way round; the reply takes just under, exactly, or over that.
# (A grant never outlives the lease it was issued under, but a heartbeat with a shorter ttl
# can bring the lease's expiry before the grant's.) When both run out together the grant's
# expiry is named, as ``grant_refusal`` names it once both have passed.
CASES = [
    pytest.param(30, 10, 9.999, None, id="grant-first-just-in-time"),
    pytest.param(30, 10, 10.0, Reason.GRANT_EXPIRED, id="grant-first-exactly-at-expiry"),
    pytest.param(30, 10, 11.0, Reason.GRANT_EXPIRED, id="grant-first-1s-late"),
    pytest.param(10, 30, 9.999, None, id="lease-first-just-in-time"),
    pytest.param(10, 30, 10.0, Reason.LEASE_EXPIRED, id="lease-first-exactly-at-expiry"),
    pytest.param(10, 30, 11.0, Reason.LEASE_EXPIRED, id="lease-first-1s-late"),
    pytest.param(10, 10, 10.0, Reason.GRANT_EXPIRED, id="together"),
]


@pytest.mark.parametrize(("lease_ttl", "grant_ttl", "delay", "expected"), CASES)
def test_invoke_refuses_a_reply_that_outlived_its_validity(
        lease_ttl: int, grant_ttl: int, delay: float, expected: Reason | None) -> None:
    store, gateway = _rig()
    lease = gateway.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=grant_ttl).grant
    assert grant is not None
    assert gateway.heartbeat(lease, ttl=lease_ttl).ok
    store.delay = delay
    calls: list[ConnectorExecutionContext] = []
    result = gateway.invoke(grant, calls.append, identity=IDENT, scopes=SCOPES)
    assert result.reason is expected
    if expected is None:
        assert len(calls) == 1 and calls[0].expires_at == START + timedelta(seconds=10)
        return
    assert calls == [] and result.context is None
    # Audited like every other refused validation.
    entry = store.audit()[-1].entry
    assert (entry.event, entry.outcome, entry.reason, entry.epoch, entry.connector_id) == (
        LifecycleEvent.GRANT_VALIDATE, Outcome.DENIED, expected, 1, "conn-a")


def test_a_fast_reply_after_a_slow_one_validates_again() -> None:
    """The refusal is about that reply, not a verdict on the grant."""
    store, gateway = _rig()
    lease = gateway.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=20).grant
    assert grant is not None
    store.delay = 25.0  # the store's clock moves too: the grant is 5 s past its expiry now
    assert gateway.validate(grant, identity=IDENT, scopes=SCOPES).reason is (
        Reason.GRANT_EXPIRED)
    store.delay = 0.0
    fresh = gateway.issue_grant(lease, scopes=SCOPES, ttl=20).grant
    assert fresh is not None
    assert gateway.validate(fresh, identity=IDENT, scopes=SCOPES).ok


@pytest.mark.parametrize(("lease_ttl", "grant_ttl", "delay", "expected"), CASES)
def test_async_invoke_refuses_a_reply_that_outlived_its_validity(
        lease_ttl: int, grant_ttl: int, delay: float, expected: Reason | None) -> None:
    async def scenario() -> None:
        mono = FakeMonotonic()
        sync = SlowReplies(ManualClock(START), mono)
        gateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(sync), AllowAllPolicy(),
                                                 id_source=CountingIds(), monotonic_clock=mono)
        lease = (await gateway.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60)).lease
        assert lease is not None
        grant = (await gateway.issue_grant(lease, scopes=SCOPES, ttl=grant_ttl)).grant
        assert grant is not None
        assert (await gateway.heartbeat(lease, ttl=lease_ttl)).ok
        sync.delay = delay
        calls: list[ConnectorExecutionContext] = []

        async def adapter(ctx: ConnectorExecutionContext) -> None:
            calls.append(ctx)

        result = await gateway.invoke(grant, adapter, identity=IDENT, scopes=SCOPES)
        assert result.reason is expected
        assert len(calls) == (1 if expected is None else 0)
        if expected is not None:
            entry = sync.audit()[-1].entry
            assert (entry.event, entry.reason) == (LifecycleEvent.GRANT_VALIDATE, expected)

    asyncio.run(scenario())


def test_the_monotonic_clock_must_be_callable() -> None:
    from mos_lease import ConfigurationError

    with pytest.raises(ConfigurationError, match="monotonic_clock"):
        ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy(), monotonic_clock=5)  # type: ignore[arg-type]
