"""Keepers report loss within 1 s of their local deadline even when the heartbeat in flight
never returns, and the abandoned heartbeat cannot bring the lease back when it finally does.

The stores here are real (in-memory, system clock) and the keepers run on real time: the
point is how late the loss is reported, which fake time cannot show. A heartbeat is made to
hang in the two ways a driver hangs: blocked on an event nobody sets, and (asyncio) holding on
to a cancelled call the way psycopg does while it waits for the server to answer its cancel
request.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    Reason,
)
from mos_lease.keeper import AsyncLeaseKeeper, LeaseKeeper, LeaseLoss, LossCause
from mos_lease.machine import Renew, Write
from mos_lease.records import AuditEntry, Snapshot, WriteOutcome
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore

IDENT = LeaseIdentity("acme", "agent-1", "binding-1")
SCOPES = ("tool:run",)
TTL = 0.6  # deadline 0.54 s after the start of the last success
LATENESS_BOUND = 1.0  # the promise: loss reported within deadline + 1 s


class StuckWrites(InMemoryLeaseStore):
    """Once ``stuck`` is set, every write blocks until ``unblock`` is set (in these tests:
    only after the loss has been reported), then goes through."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = False
        self.unblock = threading.Event()
        self.entered = threading.Event()

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        if self.stuck:
            self.entered.set()
            self.unblock.wait()
        return super().apply(write, entry)

    def renew_many(self, items: Sequence[tuple[Renew, AuditEntry]]) -> list[WriteOutcome]:
        return [self.apply(write, entry) for write, entry in items]


class AsyncStuckWrites(AsyncInMemoryLeaseStore):
    """The asyncio twin. With ``resist_cancel`` a stuck write swallows cancellation and keeps
    waiting, as a driver does that must hear the server out before it can give up."""

    def __init__(self, resist_cancel: bool) -> None:
        super().__init__()
        self.stuck = False
        self.resist_cancel = resist_cancel
        self.unblock = asyncio.Event()
        self.cancels = 0
        self.finished = asyncio.Event()

    async def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        if self.stuck:
            while True:
                try:
                    await self.unblock.wait()
                    break
                except asyncio.CancelledError:
                    self.cancels += 1
                    if not self.resist_cancel:
                        raise
        try:
            return await super().apply(write, entry)
        finally:
            self.finished.set()

    async def renew_many(self, items: Sequence[tuple[Renew, AuditEntry]]
                         ) -> list[WriteOutcome]:
        return [await self.apply(write, entry) for write, entry in items]


def _renewals(store: InMemoryLeaseStore) -> int:
    return sum(1 for r in store.audit() if r.entry.event is LifecycleEvent.HEARTBEAT)


def test_thread_keeper_reports_loss_on_time_and_the_late_reply_changes_nothing() -> None:
    store = StuckWrites()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    losses: list[LeaseLoss] = []
    keeper = LeaseKeeper(coordinator, clock_step=0,
                         ttl=TTL, clock=time.monotonic, on_lost=losses.append)
    try:
        assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
        time.sleep(0.4)  # at least one renewal went through
        assert _renewals(store) >= 1 and not keeper.lost.is_set()
        store.stuck = True
        assert store.entered.wait(2.0)  # a heartbeat is now in flight and will not return
        deadline = keeper.deadline
        assert deadline is not None
        assert keeper.lost.wait(deadline - time.monotonic() + LATENESS_BOUND)
        loss = keeper.loss
        assert loss is not None and loss.cause is LossCause.DEADLINE
        lateness = loss.at - deadline
        print(f"thread keeper: loss reported {lateness * 1000:.1f} ms after its deadline")
        assert 0 <= lateness < LATENESS_BOUND
    finally:
        store.unblock.set()  # the abandoned heartbeat now renews the lease in the store...
    until = time.monotonic() + 2
    # ``lost`` is set before on_lost runs (on the keeper's thread, after its lock is
    # released), so wait for the callback as well.
    while (_renewals(store) < 2 or not losses) and time.monotonic() < until:
        time.sleep(0.01)
    # ... and the keeper does not believe it: loss is final, no grant is minted.
    assert keeper.loss is loss and keeper.lease is None and losses == [loss]
    refused = keeper.issue_grant(scopes=SCOPES, ttl=5)
    assert refused.reason is Reason.LEASE_EXPIRED
    assert keeper.stop() is None  # nothing to release: the keeper no longer holds it


@pytest.mark.parametrize("resist_cancel", [False, True], ids=["cancellable", "holds-on"])
def test_async_keeper_reports_loss_on_time_and_the_late_reply_changes_nothing(
        resist_cancel: bool) -> None:
    async def scenario() -> None:
        store = AsyncStuckWrites(resist_cancel)
        coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        losses: list[LeaseLoss] = []
        keeper = AsyncLeaseKeeper(coordinator, clock_step=0, ttl=TTL, clock=time.monotonic,
                                  on_lost=losses.append)
        assert (await keeper.acquire(IDENT, "conn-a", scopes=SCOPES)).ok
        await asyncio.sleep(0.4)
        assert _renewals(store.sync) >= 1 and not keeper.lost.is_set()
        store.stuck = True
        deadline = keeper.deadline
        assert deadline is not None
        try:
            await asyncio.wait_for(keeper.lost.wait(),
                                   deadline - time.monotonic() + LATENESS_BOUND)
        except TimeoutError:
            pytest.fail(f"no loss reported {LATENESS_BOUND} s after the deadline")
        finally:
            if keeper.loss is None:
                store.unblock.set()  # let the stuck call (and asyncio.run) finish
        loss = keeper.loss
        assert loss is not None and loss.cause is LossCause.DEADLINE
        assert loss.error == "heartbeat still running at the deadline"
        lateness = loss.at - deadline
        print(f"async keeper ({'holds on' if resist_cancel else 'cancellable'}): loss "
              f"reported {lateness * 1000:.1f} ms after its deadline")
        assert 0 <= lateness < LATENESS_BOUND
        assert store.cancels == 1  # the abandoned heartbeat was told to stop
        if resist_cancel:
            # It is still running; when it finally returns a renewal, nothing changes.
            store.unblock.set()
            await asyncio.wait_for(store.finished.wait(), 2)
            await asyncio.sleep(0)
            assert _renewals(store.sync) >= 2  # the late renewal did commit in the store
        assert keeper.loss is loss and keeper.lease is None and losses == [loss]
        refused = await keeper.issue_grant(scopes=SCOPES, ttl=5)
        assert refused.reason is Reason.LEASE_EXPIRED
        assert await keeper.stop() is None
        await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}  # nothing left dangling

    asyncio.run(scenario())


def test_heartbeats_go_through_the_heartbeat_coordinator_the_rest_does_not() -> None:
    shared = InMemoryLeaseStore()

    class Writes(InMemoryLeaseStore):
        """A second front on ``shared`` that counts the writes sent through it."""

        def __init__(self) -> None:
            super().__init__()
            self.applied = 0

        def load(self, identity: LeaseIdentity) -> Snapshot:
            return shared.load(identity)

        def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
            self.applied += 1
            return shared.apply(write, entry)

        def record(self, entry: AuditEntry) -> None:
            shared.record(entry)

    work_front, beat_front = Writes(), Writes()
    policy = AllowAllPolicy()
    now = [0.0]
    keeper = LeaseKeeper(ConnectorLeaseCoordinator(work_front, policy), clock_step=0, ttl=TTL,
                         background=False, clock=lambda: now[0], random=lambda: 0.5,
                         heartbeat_coordinator=ConnectorLeaseCoordinator(beat_front, policy))
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    assert keeper.issue_grant(scopes=SCOPES, ttl=5).ok
    now[0] = 0.3  # past the renewal time (ttl / 3 = 0.2 s), before the deadline (0.54 s)
    keeper.step()
    assert (work_front.applied, beat_front.applied) == (1, 1)  # acquire; the renewal
    assert _renewals(shared) == 1 and keeper.lease is not None


def test_the_heartbeat_coordinator_must_match_the_keeper() -> None:
    sync = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    asynchronous = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
    with pytest.raises(ConfigurationError, match="heartbeat_coordinator"):
        LeaseKeeper(sync, clock_step=0,
                    ttl=TTL, heartbeat_coordinator=asynchronous)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="heartbeat_coordinator"):
        AsyncLeaseKeeper(asynchronous, clock_step=0, ttl=TTL,
                         heartbeat_coordinator=sync)  # type: ignore[arg-type]
