"""The supervisor on PostgreSQL: a few hundred bindings renewed by one round trip per tick,
a rival's takeover of one binding leaving the others untouched, and loss at the deadline
when renewals hang."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    LossCause,
    Reason,
)
from mos_lease.supervisor import (
    AsyncSupervisor,
    BindingLost,
    BindingStarted,
    Change,
    NewHolder,
    Supervisor,
)
from mos_lease.vocabulary import LeaseState
from tests.pg_clock import ShiftedAsyncPostgresLeaseStore
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ("tool:run",)
TTL = 30.0
N = 300


class Counted:
    """A store whose calls are counted by name (and may be made to hang)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: dict[str, int] = {}
        self.hang: threading.Event | None = None  # renew_many waits on it when set

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if not callable(attribute) or name.startswith("_") or name in ("advance",):
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            hang = self.hang
            if hang is not None and name == "renew_many":
                hang.wait()
            return attribute(*args, **kwargs)

        return counted


class FakeTime:
    """The supervisor's monotonic clock, moved with the store's clock offset."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.mono = 1000.0

    def __call__(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.store.advance(seconds)


def _settle(supervisor: Supervisor, sleeps: list[float]) -> None:
    for _ in range(10_000):
        before = len(sleeps)
        supervisor.turn()
        if len(sleeps) > before:
            return
    raise AssertionError("the supervisor never went to sleep")


def _run(supervisor: Supervisor, sleeps: list[float], clock: FakeTime, seconds: float,
         step: float = 0.5) -> None:
    end = clock.mono + seconds
    while True:
        _settle(supervisor, sleeps)
        if clock.mono >= end:
            return
        clock.advance(step)


def test_a_few_hundred_bindings_one_round_trip_per_renewal_tick_and_a_rival_takeover(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    inner = pg_stores()
    store = Counted(inner)
    clock = FakeTime(inner)
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy(),
                                            monotonic_clock=clock)
    changes: list[Change] = []
    sleeps: list[float] = []
    supervisor = Supervisor(coordinator, on_change=changes.append, clock=clock,
                            sleep=sleeps.append, random=lambda: 0.5, background=False)
    identities = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(N)]
    for identity in identities:
        supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=TTL)
    _settle(supervisor, sleeps)
    assert sum(isinstance(c, BindingStarted) for c in changes) == N
    # One read of every holder, then one insert of every lease: a round trip each.
    assert store.calls == {"load_many": 1, "acquire_many": 1}

    for tick in range(3):
        store.calls.clear()
        _run(supervisor, sleeps, clock, TTL / 3 + 1)
        # Every lease renewed by one heartbeat_many round trip per tick.
        assert store.calls == {"renew_many": 1}, (tick, store.calls)
    leases = {identity: supervisor.lease(identity) for identity in identities}
    assert all(lease is not None for lease in leases.values())

    rival = ConnectorLeaseCoordinator(inner, AllowAllPolicy())
    victim = identities[123]
    assert rival.takeover(victim, "gw-b", scopes=SCOPES, ttl=TTL, expected_epoch=1).ok
    changes.clear()
    store.calls.clear()
    _run(supervisor, sleeps, clock, TTL / 3 + 1)
    lost = [c for c in changes if isinstance(c, BindingLost)]
    assert [(c.identity, c.loss.cause, c.loss.reason) for c in lost] == [
        (victim, LossCause.DENIED, Reason.STALE_EPOCH)]
    seen = [c for c in changes if isinstance(c, NewHolder)]
    assert [(c.holder.connector_id, c.holder.epoch) for c in seen] == [("gw-b", 2)]
    # The batch still went out in one round trip; the refused renewal was audited on its own.
    assert store.calls["renew_many"] == 1
    audit = inner.audit(victim)
    assert [(r.entry.outcome, r.entry.reason) for r in audit][-1][1] is Reason.STALE_EPOCH
    for identity in identities:
        if identity == victim:
            assert supervisor.lease(identity) is None
            continue
        now, before = supervisor.lease(identity), leases[identity]
        assert now is not None and before is not None
        assert (now.lease_id, now.epoch) == (before.lease_id, before.epoch)
        assert now.expires_at > before.expires_at
    supervisor.close()
    assert rival.current_holder(identities[0]).state is LeaseState.RELEASED  # type: ignore[union-attr]
    assert rival.current_holder(victim).connector_id == "gw-b"  # type: ignore[union-attr]


def test_each_binding_is_lost_within_a_second_of_its_deadline_when_renewals_hang(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = Counted(pg_stores())
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    clock: Callable[[], float] = coordinator.monotonic
    reported: dict[LeaseIdentity, tuple[float, Change]] = {}
    started = threading.Event()
    identities = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(40)]

    def on_change(change: Change) -> None:
        if isinstance(change, BindingLost):
            reported[change.identity] = (clock(), change)
        if sum(isinstance(c, BindingStarted) for c in [change]) and \
                all(supervisor.lease(i) is not None for i in identities):
            started.set()

    supervisor = Supervisor(coordinator, on_change=on_change)
    for identity in identities:
        supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=3, clock_step=0)
    try:
        assert started.wait(10)
        store.hang = threading.Event()  # every renewal from now on hangs
        end = time.monotonic() + 6
        while len(reported) < len(identities) and time.monotonic() < end:
            time.sleep(0.05)
        assert set(reported) == set(identities)
        slots = supervisor._core.schedule.slots
        for identity, (at, change) in reported.items():
            assert isinstance(change, BindingLost)
            assert change.loss.cause is LossCause.DEADLINE
            state = slots[identity].state
            assert state is not None  # keeps the deadline that was in force
            # Recorded at the deadline, never before, and reported at once.
            assert 0 <= change.loss.at - state.deadline < 1.0
            assert at - change.loss.at < 1.0
    finally:
        if store.hang is not None:
            store.hang.set()
        supervisor.close()


def test_the_asyncio_supervisor_on_postgresql(pg_dsn: str, pg_tenant: str) -> None:
    async def main() -> None:
        async with ShiftedAsyncPostgresLeaseStore(pg_dsn) as store:
            coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            identities = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(50)]
            async with AsyncSupervisor(coordinator) as supervisor:
                changes = supervisor.changes()
                for identity in identities:
                    supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=TTL)
                started = 0
                async for change in changes:
                    started += isinstance(change, BindingStarted)
                    if started == len(identities):
                        break
                rival = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
                assert (await rival.takeover(identities[5], "gw-b", scopes=SCOPES, ttl=TTL,
                                             expected_epoch=1)).ok
            views = [await rival.current_holder(i) for i in identities]
            assert [v.state if v else None for v in views].count(LeaseState.RELEASED) == 49

    asyncio.run(main())
