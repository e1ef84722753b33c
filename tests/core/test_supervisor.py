"""The supervisor on the in-memory store with fake time: the pure schedule (Hypothesis), and
both drivers driven turn by turn (``background=False``)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar
from uuid import uuid4

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    LeaseResult,
    LossCause,
    Reason,
    StoreUnavailable,
)
from mos_lease.clock import ManualClock
from mos_lease.keep.schedule import BATCH, Schedule
from mos_lease.keep.slots import AcquireDue, Due, ReadHolder, RenewalBatch, TakeoverDue
from mos_lease.keep.turn import Core
from mos_lease.keeper import KeeperTiming
from mos_lease.machine import Renew as RenewWrite
from mos_lease.records import AuditEntry, WriteOutcome
from mos_lease.results import HolderView
from mos_lease.supervisor import (
    AsyncSupervisor,
    Binding,
    BindingLost,
    BindingStarted,
    Change,
    NewHolder,
    Supervisor,
)
from mos_lease.vocabulary import LeaseState, Outcome
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.helpers import Time

START = datetime(2030, 1, 1, tzinfo=UTC)
SCOPES = ("tool:run",)
TTL = 30.0  # renew every ~10 s; deadline 30 - (3 + 2) = 25 s after the start of a renewal


def ident(n: int) -> LeaseIdentity:
    return LeaseIdentity("acme", f"agent-{n}", "b")


def released(store: InMemoryLeaseStore, identity: LeaseIdentity) -> bool:
    row = store.load(identity).row
    return row is not None and row.released_at is not None


class Counting(InMemoryLeaseStore):
    """Counts the store calls, and can make them fail. A batch skips a row ``held`` by
    another transaction (``reached=False``), as the PostgreSQL store's batch skips a row a
    fenced transaction holds."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.calls: dict[str, int] = {}
        self.order: list[str] = []  # the calls, in the order they were made
        self.rows_read = 0  # by load and load_many: how many holders were read
        self.down = False
        self.held: set[LeaseIdentity] = set()
        self._batch = False  # the in-memory renew_many applies each write: one call

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.order.append(name)
        if self.down:
            raise StoreUnavailable(f"{name}: connection refused")

    def load(self, identity: LeaseIdentity) -> Any:
        self._count("load")
        self.rows_read += 1
        return super().load(identity)

    def apply(self, write: Any, entry: AuditEntry) -> WriteOutcome:
        if not self._batch:
            self._count("apply")
        return super().apply(write, entry)

    def renew_many(self, items: Sequence[tuple[RenewWrite, AuditEntry]]) -> list[WriteOutcome]:
        return self._many("renew_many", super().renew_many, items)

    def acquire_many(self, items: Sequence[tuple[Any, AuditEntry]]) -> list[WriteOutcome]:
        return self._many("acquire_many", super().acquire_many, items)

    def takeover_many(self, items: Sequence[tuple[Any, AuditEntry]]) -> list[WriteOutcome]:
        return self._many("takeover_many", super().takeover_many, items)

    def release_many(self, items: Sequence[tuple[Any, AuditEntry]]) -> list[WriteOutcome]:
        return self._many("release_many", super().release_many, items)

    def load_many(self, identities: Sequence[LeaseIdentity]) -> Any:
        self._count("load_many")
        self.rows_read += len(identities)
        return super().load_many(identities)

    def _many(self, name: str, call: Callable[[list[Any]], list[WriteOutcome]],
              items: Sequence[tuple[Any, AuditEntry]]) -> list[WriteOutcome]:
        self._count(name)
        self._batch = True  # one call, however many writes it applies
        try:
            reached = iter(call([item for item in items
                                 if item[0].identity not in self.held]))
        finally:
            self._batch = False
        now = self.clock.now()
        return [WriteOutcome(None, now, reached=False) if write.identity in self.held
                else next(reached) for write, _ in items]

    def record(self, entry: AuditEntry) -> None:
        self._count("record")
        super().record(entry)

    def reset(self) -> None:
        self.calls.clear()
        self.order.clear()
        self.rows_read = 0

    def total(self) -> int:
        return sum(self.calls.values())


class Rig:
    def __init__(self) -> None:
        self.time = Time()
        self.store = Counting(self.time.wall)
        self.coordinator = ConnectorLeaseCoordinator(self.store, AllowAllPolicy(),
                                                     monotonic_clock=self.time)
        self.changes: list[Change] = []
        self.sleeps: list[float] = []
        self.supervisor = Supervisor(self.coordinator, on_change=self.changes.append,
                                     clock=self.time, sleep=self.sleeps.append,
                                     random=lambda: 0.5, background=False)

    def run(self, seconds: float, step: float = 0.5) -> None:
        """Turn until nothing is due, then move time by ``step``; for ``seconds``."""
        end = self.time.mono + seconds
        while True:
            self.settle()
            if self.time.mono >= end:
                return
            self.time.advance(step)

    def settle(self) -> None:
        for _ in range(100_000):
            before = len(self.sleeps)
            self.supervisor.turn()
            if len(self.sleeps) > before:
                return
        raise AssertionError("the supervisor never went to sleep")

    def add(self, n: int, **options: Any) -> None:
        for i in range(n):
            self.supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL, **options)

    def of(self, kind: type[Any], identity: LeaseIdentity | None = None) -> list[Any]:
        return [c for c in self.changes if isinstance(c, kind)
                and (identity is None or c.identity == identity)]


def test_many_bindings_are_campaigned_for_held_and_renewed_in_batches() -> None:
    rig = Rig()
    rig.add(2500)
    rig.settle()
    assert len(rig.of(BindingStarted)) == 2500
    assert all(rig.supervisor.lease(ident(i)) is not None for i in range(0, 2500, 97))
    rig.store.calls.clear()
    rig.run(12)  # one renewal interval (ttl / 3) and a little
    # One heartbeat_many round trip per 1,000 leases, and nothing else.
    assert rig.store.calls == {"renew_many": math.ceil(2500 / BATCH)}
    assert not rig.of(BindingLost)
    for i in (0, 1234, 2499):
        lease = rig.supervisor.lease(ident(i))
        assert lease is not None and lease.expires_at > rig.time.wall.now()


def test_a_rival_takeover_loses_one_binding_and_leaves_the_others_untouched() -> None:
    rig = Rig()
    rig.add(20)
    rig.settle()
    before = {i: rig.supervisor.lease(ident(i)) for i in range(20)}
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    taken = rival.takeover(ident(7), "gw-b", scopes=SCOPES, ttl=TTL, expected_epoch=1)
    assert taken.ok
    rig.run(12)
    lost = rig.of(BindingLost)
    assert [c.identity for c in lost] == [ident(7)]
    assert lost[0].loss.cause is LossCause.DENIED
    assert lost[0].loss.reason is Reason.STALE_EPOCH
    assert rig.supervisor.lease(ident(7)) is None
    # The campaign goes on: it sees the rival's lease and waits for it.
    seen = rig.of(NewHolder, ident(7))
    assert seen and seen[-1].holder.connector_id == "gw-b" and seen[-1].holder.epoch == 2
    for i in range(20):
        if i != 7:
            now = rig.supervisor.lease(ident(i))
            old = before[i]
            assert now is not None and old is not None
            assert (now.lease_id, now.epoch) == (old.lease_id, old.epoch)


def test_the_campaign_takes_over_once_the_rival_lease_expires() -> None:
    rig = Rig()
    rig.add(3)
    rig.settle()
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    assert rival.takeover(ident(1), "gw-b", scopes=SCOPES, ttl=5, expected_epoch=1).ok
    rig.run(10, step=0.25)
    started = rig.of(BindingStarted, ident(1))
    assert len(started) == 2 and started[-1].lease.epoch == 3
    assert rig.supervisor.lease(ident(1)) == started[-1].lease


def test_loss_is_reported_within_a_second_of_the_deadline_when_renewals_fail() -> None:
    rig = Rig()
    rig.add(5)
    rig.settle()
    lease = rig.supervisor.lease(ident(0))
    assert lease is not None
    # acquired at "now" (random 0.5); no clock step over the in-memory store
    deadline = rig.time.mono + TTL - TTL / 10
    rig.store.down = True
    rig.run(30, step=0.1)
    lost = rig.of(BindingLost)
    assert len(lost) == 5
    for change in lost:
        assert change.loss.cause is LossCause.DEADLINE
        assert change.loss.reason is Reason.LEASE_EXPIRED
        assert "StoreUnavailable" in (change.loss.error or "")
        assert deadline <= change.loss.at < deadline + 1.0


def test_a_lease_the_batch_did_not_reach_is_retried_alone_until_its_own_deadline() -> None:
    """A renewal the store did not reach (its row held by another transaction) is a
    transient failure of that lease alone: ``store_unavailable``, nothing recorded, retried
    with backoff; every other lease of the batch is renewed on every tick. Renewed once the
    row is free; lost at its own deadline if it never is."""
    rig = Rig()
    rig.add(10)
    rig.settle()
    held = ident(3)
    first = rig.supervisor.lease(held)
    assert first is not None
    rig.store.held.add(held)
    results = rig.coordinator.heartbeat_many([first], ttl=TTL)
    assert [(r.outcome, r.reason, r.lease) for r in results] == [
        (Outcome.DENIED, Reason.STORE_UNAVAILABLE, None)]
    assert "record" not in rig.store.calls  # not a refusal: nothing was audited
    for _ in range(2):  # two renewal ticks, within the 27 s deadline
        before = {i: rig.supervisor.lease(ident(i)) for i in range(10)}
        rig.run(TTL / 3 + 0.5)
        assert not rig.of(BindingLost)
        for i in range(10):
            lease, earlier = rig.supervisor.lease(ident(i)), before[i]
            assert lease is not None and earlier is not None
            assert (lease.expires_at == earlier.expires_at) is (ident(i) == held)
    rig.store.held.clear()
    rig.run(3)
    renewed = rig.supervisor.lease(held)
    assert renewed is not None and renewed.expires_at > first.expires_at
    assert not rig.of(BindingLost)
    rig.store.held.add(held)
    deadline = rig.time.mono + TTL - TTL / 10  # at most: the last renewal began earlier
    rig.run(TTL, step=0.1)
    (lost,) = rig.of(BindingLost)
    assert (lost.identity, lost.loss.cause, lost.loss.reason) == (
        held, LossCause.DEADLINE, Reason.LEASE_EXPIRED)
    assert "store_unavailable" in (lost.loss.error or "")
    assert lost.loss.at < deadline
    assert all(rig.supervisor.lease(ident(i)) is not None for i in range(10) if i != 3)


def test_after_a_deadline_loss_the_campaign_takes_the_lease_back_once_it_expires() -> None:
    rig = Rig()
    rig.add(2)
    rig.settle()
    rig.store.down = True
    rig.run(28, step=0.1)  # the deadline: ttl - ttl / 10 (no clock step in memory)
    assert len(rig.of(BindingLost)) == 2
    rig.store.down = False
    rig.run(10, step=0.25)  # the old lease (ttl 30 from its last renewal) expires meanwhile
    for i in range(2):
        started = rig.of(BindingStarted, ident(i))
        assert [c.lease.epoch for c in started] == [1, 2]


def test_remove_releases_the_lease_and_reports_it_stopped() -> None:
    rig = Rig()
    rig.add(3)
    rig.settle()
    result = rig.supervisor.remove(ident(1))
    assert result is not None and result.ok
    assert released(rig.store, ident(1))
    lost = rig.of(BindingLost)
    assert [(c.identity, c.loss.cause) for c in lost] == [(ident(1), LossCause.STOPPED)]
    assert rig.supervisor.bindings == [ident(0), ident(2)]
    with pytest.raises(InvalidInput):
        rig.supervisor.remove(ident(1))
    rig.run(12)
    assert len(rig.of(BindingStarted, ident(1))) == 1  # no campaign for a removed binding


def test_a_lease_won_for_a_binding_removed_meanwhile_is_released() -> None:
    rig = Rig()
    rig.add(1)
    schedule = rig.supervisor._core.schedule
    due = schedule.due(rig.time())
    (call,) = due.campaigns
    rig.supervisor.remove(ident(0))  # while the acquire is "in flight"
    result = rig.coordinator.acquire(ident(0), "gw-a", scopes=SCOPES, ttl=TTL)
    changes, orphan = schedule.campaigned(call, result, rig.time(), rig.time())
    assert changes == [] and orphan == result.lease


def test_close_releases_every_held_lease() -> None:
    rig = Rig()
    rig.add(4)
    rig.settle()
    seen = rig.supervisor.changes()
    rig.supervisor.close()
    assert all(released(rig.store, ident(i)) for i in range(4))
    assert [c.loss.cause for c in rig.of(BindingLost)] == [LossCause.STOPPED] * 4
    assert [type(c) for c in seen] == [BindingLost] * 4  # the iterator ends on close
    with pytest.raises(ConfigurationError):
        rig.add(1)


class StatusDuringClose:
    """An ``on_change`` that asks for the lease of every binding (and of an identity never
    added) each time close() reports a binding stopped: a status request during shutdown."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.supervisor: Supervisor | AsyncSupervisor | None = None
        self.answers: list[list[LeaseHandle | None] | BaseException] = []
        self.unknown: list[BaseException | None] = []

    def __call__(self, change: Change) -> None:
        if not isinstance(change, BindingLost) or change.loss.cause is not LossCause.STOPPED:
            return
        assert self.supervisor is not None
        try:
            self.answers.append([self.supervisor.lease(ident(i)) for i in range(self.n)])
        except InvalidInput as refused:
            self.answers.append(refused)
        try:
            self.supervisor.lease(ident(999))
            self.unknown.append(None)
        except InvalidInput as refused:
            self.unknown.append(refused)

    def check(self) -> None:
        """Every binding, dropped already or not yet, reads ``None`` while closing; an
        identity never added is refused, then and after."""
        assert self.supervisor is not None
        assert self.answers == [[None] * self.n] * self.n, self.answers
        assert all(isinstance(refused, InvalidInput) for refused in self.unknown)
        assert len(self.unknown) == self.n
        assert all(self.supervisor.lease(ident(i)) is None for i in range(self.n))
        with pytest.raises(InvalidInput):
            self.supervisor.lease(ident(999))


def test_a_closing_supervisor_answers_none_for_its_bindings() -> None:
    rig = Rig()
    status = StatusDuringClose(4)
    rig.supervisor = status.supervisor = Supervisor(
        rig.coordinator, on_change=status, clock=rig.time, sleep=rig.sleeps.append,
        random=lambda: 0.5, background=False)
    rig.add(4)
    rig.settle()
    assert all(rig.supervisor.lease(ident(i)) is not None for i in range(4))
    rig.supervisor.close()
    assert all(released(rig.store, ident(i)) for i in range(4))
    status.check()


def test_inputs_are_checked_when_a_binding_is_added() -> None:
    rig = Rig()
    with pytest.raises(InvalidInput):
        rig.supervisor.add(ident(0), "", scopes=SCOPES, ttl=TTL)
    with pytest.raises(InvalidInput):
        rig.supervisor.add(ident(0), "gw-a", scopes=["not a scope!"], ttl=TTL)
    with pytest.raises(ConfigurationError):
        rig.supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=1,
                           clock_step=2)  # margin >= ttl
    rig.supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=TTL)
    with pytest.raises(InvalidInput):
        rig.supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=TTL)
    with pytest.raises(ConfigurationError):
        Supervisor(AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore()))  # type: ignore[arg-type]


def test_the_thread_supervisor_uses_one_thread() -> None:
    import threading

    store = InMemoryLeaseStore()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    before = threading.active_count()
    with Supervisor(coordinator) as supervisor:
        changes = supervisor.changes()
        for i in range(200):
            supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
        started = 0
        for change in changes:
            started += isinstance(change, BindingStarted)
            if started == 200:
                break
        # The supervisor's thread, and at most one short-lived thread for a call.
        assert threading.active_count() - before <= 2
    assert all(released(store, ident(i)) for i in range(200))


# --- the asyncio supervisor --------------------------------------------------------------


S = TypeVar("S", bound=AsyncInMemoryLeaseStore)


class AsyncRig(Generic[S]):
    """:class:`Rig` for the asyncio supervisor, over an asyncio store built on the rig's
    wall clock by ``store_of``."""

    def __init__(self, store_of: Callable[[InMemoryLeaseStore], S]) -> None:
        self.time = Time()
        self.store = store_of(InMemoryLeaseStore(self.time.wall))
        self.coordinator = AsyncConnectorLeaseCoordinator(self.store, AllowAllPolicy(),
                                                          monotonic_clock=self.time)
        self.changes: list[Change] = []
        self.sleeps: list[float] = []

        async def sleep(seconds: float) -> None:
            self.sleeps.append(seconds)

        self.supervisor = AsyncSupervisor(self.coordinator, on_change=self.changes.append,
                                          clock=self.time, sleep=sleep, random=lambda: 0.5,
                                          background=False)



def test_a_closing_asyncio_supervisor_answers_none_for_its_bindings() -> None:
    async def main() -> None:
        rig = AsyncRig(AsyncInMemoryLeaseStore)
        status = StatusDuringClose(4)

        async def sleep(seconds: float) -> None:
            rig.sleeps.append(seconds)

        supervisor = status.supervisor = AsyncSupervisor(
            rig.coordinator, on_change=status, clock=rig.time, sleep=sleep,
            random=lambda: 0.5, background=False)
        for i in range(4):
            supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
        while not all(supervisor.lease(ident(i)) is not None for i in range(4)):
            await supervisor.turn()
        await supervisor.close()
        for i in range(4):
            row = (await rig.store.load(ident(i))).row
            assert row is not None and row.released_at is not None
        status.check()

    asyncio.run(main())


def test_asyncio_close_waits_at_most_its_timeout_for_the_task_then_releases() -> None:
    """A task that does not end when cancelled (its sleep swallows the cancellation) holds
    ``close()`` up at most ``timeout`` seconds, as the thread supervisor's join does; the
    leases are released all the same."""
    async def main() -> None:
        rig = AsyncRig(AsyncInMemoryLeaseStore)
        stubborn: list[float] = []

        async def sleep(seconds: float) -> None:
            try:
                await asyncio.sleep(min(seconds, 0.01))
            except asyncio.CancelledError:
                stubborn.append(seconds)
                await asyncio.sleep(5.0)  # ends long after close() has given up on it
                raise

        supervisor = AsyncSupervisor(rig.coordinator, clock=rig.time, sleep=sleep,
                                     random=lambda: 0.5)
        supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=TTL)
        while supervisor.lease(ident(0)) is None:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await supervisor.close(timeout=0.2)
        assert stubborn and 0.2 <= loop.time() - started < 4.0
        row = (await rig.store.load(ident(0))).row
        assert row is not None and row.released_at is not None

    asyncio.run(main())


def test_the_asyncio_supervisor_holds_renews_and_loses_one_binding() -> None:
    async def main() -> None:
        rig = AsyncRig(AsyncInMemoryLeaseStore)
        time, store, changes, sleeps, supervisor = (
            rig.time, rig.store, rig.changes, rig.sleeps, rig.supervisor)

        async def settle() -> None:
            before = len(sleeps)
            while len(sleeps) == before:
                await supervisor.turn()

        for i in range(30):
            supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
        await settle()
        assert len([c for c in changes if isinstance(c, BindingStarted)]) == 30
        rival = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        assert (await rival.takeover(ident(3), "gw-b", scopes=SCOPES, ttl=TTL,
                                     expected_epoch=1)).ok
        for _ in range(24):
            time.advance(0.5)
            await settle()
        lost = [c for c in changes if isinstance(c, BindingLost)]
        assert [c.identity for c in lost] == [ident(3)]
        assert lost[0].loss.cause is LossCause.DENIED
        assert all(supervisor.lease(ident(i)) is not None for i in range(30) if i != 3)
        assert (await supervisor.issue_grant(ident(4), scopes=SCOPES, ttl=10)).ok
        assert (await supervisor.issue_grant(ident(3), scopes=SCOPES, ttl=10)).reason \
            is Reason.STALE_EPOCH  # the loss, refused locally
        removed = await supervisor.remove(ident(0))
        assert removed is not None and removed.ok
        await supervisor.close()
        for i in range(1, 30):
            if i != 3:
                row = (await store.load(ident(i))).row
                assert row is not None and row.released_at is not None

    asyncio.run(main())


def test_the_asyncio_supervisor_runs_as_one_task_and_reports_through_an_iterator() -> None:
    async def main() -> None:
        store = AsyncInMemoryLeaseStore()
        coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        before = len(asyncio.all_tasks())
        async with AsyncSupervisor(coordinator) as supervisor:
            changes = supervisor.changes()
            for i in range(100):
                supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
            started = 0
            async for change in changes:
                started += isinstance(change, BindingStarted)
                # The supervisor's task, and at most one task for the call in flight.
                assert len(asyncio.all_tasks()) - before <= 2
                if started == 100:
                    break
        for i in range(100):
            row = (await store.load(ident(i))).row
            assert row is not None and row.released_at is not None

    asyncio.run(main())


# --- the pure schedule ------------------------------------------------------------------------


def _binding(n: int, ttl: float = TTL) -> Binding:
    return Binding(ident(n), "gw-a", SCOPES, KeeperTiming(ttl))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_schedule_under_any_outcomes(data: st.DataObject) -> None:
    """Drive the schedule with arbitrary outcomes and times: no slot is in two calls at once,
    every batch is within the cap and of one ttl, a held lease is never renewed past its
    deadline, each loss is reported once, and the schedule always wakes up in the future."""
    schedule = Schedule(lambda: data.draw(st.floats(0, 0.999)))
    now = 0.0
    n = data.draw(st.integers(1, 6))
    for i in range(n):
        schedule.add(_binding(i, data.draw(st.sampled_from([10.0, TTL]))), now)
    leases: dict[LeaseIdentity, Any] = {}

    def track(changes: list[Change]) -> None:
        """Each lease is reported started once, then lost once."""
        for change in changes:
            if isinstance(change, BindingLost):
                assert leases.pop(change.identity) is change.lease
            elif isinstance(change, BindingStarted):
                assert change.identity not in leases
                leases[change.identity] = change.lease

    for _ in range(data.draw(st.integers(1, 40))):
        now += data.draw(st.floats(0, 8))
        due = schedule.due(now)
        assert due.wake_at > now or due.renewals or due.campaigns
        in_calls = [s for r in due.renewals for s in r.slots] + [c.slot for c in due.campaigns]
        assert len(in_calls) == len({id(s) for s in in_calls})
        track(due.changes)
        if data.draw(st.booleans()):  # a binding removed (and added again) mid-turn
            removed = data.draw(st.sampled_from(sorted(schedule.slots, key=str)))
            released, more = schedule.remove(removed, now)
            assert (released is not None) == (removed in leases)
            assert [type(c) for c in more] == ([BindingLost] if released else [])
            track(more)
            schedule.add(Binding(removed, "gw-a", SCOPES, KeeperTiming(TTL)), now)
        for renew in due.renewals:
            assert 0 < len(renew.slots) <= BATCH
            assert {s.binding.timing.ttl for s in renew.slots} == {renew.ttl}
            for slot in renew.slots:
                assert slot.state is not None and now < slot.state.deadline
            outcome, finished = _renewal_outcome(data, renew, now,
                                                 schedule.earliest_deadline())
            track(schedule.renewed(renew, outcome, now, finished))
        for call in due.campaigns:
            result = _campaign_outcome(data, call)
            more, orphan = schedule.campaigned(call, result, now, now)
            won = isinstance(result, LeaseResult) and result.ok
            # A lease won for a binding removed meanwhile goes back to the driver to release.
            assert (orphan is not None) == (won and call.slot.removed)
            assert not (call.slot.removed and more)
            track(more)
        for identity, slot in schedule.slots.items():
            assert slot.holding == (identity in leases)
            assert not slot.busy


def _renewal_outcome(data: st.DataObject, renew: RenewalBatch, now: float,
                     limit: float) -> tuple[Any, float]:
    """An outcome for ``renew``; abandoned (``None``) at ``limit``, the earliest deadline."""
    kind = data.draw(st.sampled_from(["ok", "denied", "down", "overdue"]))
    finished = now + data.draw(st.floats(0, 3))
    if kind == "overdue":
        return None, limit
    if kind == "down":
        return StoreUnavailable("down"), finished
    if kind == "ok":
        return [LeaseResult(Outcome.RENEWED, None, "c", lease=lease)
                for lease in renew.leases], finished
    return [LeaseResult(Outcome.DENIED, Reason.LEASE_REPLACED, "c")
            for _ in renew.leases], finished


def _campaign_outcome(data: st.DataObject, call: AcquireDue | TakeoverDue | ReadHolder) -> Any:
    outcome = data.draw(st.sampled_from(["win", "held", "down", "none"]))
    if outcome == "down":
        return StoreUnavailable("down")
    if isinstance(call, ReadHolder):
        state = data.draw(st.sampled_from([None, *LeaseState]))
        if state is None:
            return None
        epoch = data.draw(st.integers(1, 5))
        return HolderView("gw-b", epoch, state, START + timedelta(seconds=5), START)
    if outcome == "win":
        epoch = 1 if isinstance(call, AcquireDue) else call.expected_epoch + 1
        return LeaseResult(Outcome.ACQUIRED, None, "c",
                           lease=_handle(call.slot.binding.identity, epoch))
    return LeaseResult(Outcome.DENIED, Reason.LEASE_HELD, "c")


def test_the_schedule_sends_one_batch_per_thousand_leases_of_one_ttl() -> None:
    schedule = Schedule(lambda: 0.5)
    for i in range(2100):
        schedule.add(_binding(i, 10.0 if i % 2 else TTL), 0.0)
    due = schedule.due(0.0)
    _acquire_all(schedule, due)
    due = schedule.due(0.0)
    assert not due.renewals and due.wake_at == pytest.approx(10.0 / 3)
    due = schedule.due(10.0 / 3)  # the ttl-10 leases are due; the ttl-30 ones are not yet
    assert sorted(len(r.slots) for r in due.renewals) == [50, 1000]
    assert {r.ttl for r in due.renewals} == {10.0}


def _acquire_all(schedule: Schedule, due: Due) -> None:
    """At time 0, the first reads of new bindings find no lease; the acquires then win."""
    assert {type(call) for call in due.campaigns} == {ReadHolder}
    for call in due.campaigns:
        schedule.campaigned(call, None, 0.0, 0.0)
    for call in schedule.due(0.0).campaigns:
        assert isinstance(call, AcquireDue)
        handle = _handle(call.slot.binding.identity)
        schedule.campaigned(call, LeaseResult(Outcome.ACQUIRED, None, "c", lease=handle),
                            0.0, 0.0)


def _handle(identity: LeaseIdentity, epoch: int = 1) -> LeaseHandle:
    return LeaseHandle(identity, "gw-a", uuid4(), epoch, SCOPES, START)


def test_grants_are_minted_for_held_bindings_and_refused_locally_otherwise() -> None:
    rig = Rig()
    rig.add(3)
    rig.settle()
    issued = rig.supervisor.issue_grant(ident(0), scopes=SCOPES, ttl=10)
    assert issued.ok and issued.grant is not None
    assert rig.coordinator.validate(issued.grant, identity=ident(0), scopes=SCOPES).ok
    # A rival takes binding 1: the store's refusal is the binding's loss at once.
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    assert rival.takeover(ident(1), "gw-b", scopes=SCOPES, ttl=TTL, expected_epoch=1).ok
    refused = rig.supervisor.issue_grant(ident(1), scopes=SCOPES, ttl=10)
    assert not refused.ok
    lost = rig.of(BindingLost, ident(1))
    assert len(lost) == 1 and lost[0].loss.reason is refused.reason
    assert rig.supervisor.lease(ident(1)) is None
    calls = rig.store.total()
    again = rig.supervisor.issue_grant(ident(1), scopes=SCOPES, ttl=10)
    assert again.reason is refused.reason and rig.store.total() == calls  # local: no call
    # Past the local deadline (renewals failing), a grant is refused locally too.
    rig.store.down = True
    rig.run(28, step=0.5)  # past ttl - ttl / 10 (no clock step in memory)
    rig.store.down = False
    calls = rig.store.total()
    late = rig.supervisor.issue_grant(ident(2), scopes=SCOPES, ttl=10)
    assert late.reason is Reason.LEASE_EXPIRED and rig.store.total() == calls
    # A binding that never held a lease.
    rig.supervisor.add(ident(9), "gw-a", scopes=SCOPES, ttl=TTL)
    assert rig.supervisor.issue_grant(ident(9), scopes=SCOPES, ttl=10).reason \
        is Reason.LEASE_MISSING


def test_the_batches_of_a_slow_tick_stay_one_tick() -> None:
    """Ten batches one after another take a while; the next renewal of all of them is due
    from the tick's start, so they go out together again (the deadlines still count from
    each call's own start)."""
    schedule = Schedule(lambda: 0.5)
    timing = KeeperTiming(15.0, jitter=0.0)
    for i in range(2500):
        schedule.add(Binding(ident(i), "gw-a", SCOPES, timing), 0.0)
    _acquire_all(schedule, schedule.due(0.0))
    due = schedule.due(5.0)
    assert [len(r.slots) for r in due.renewals] == [1000, 1000, 500]
    for k, renew in enumerate(due.renewals):  # each batch takes 1.5 s
        started = 5.0 + 1.5 * k
        results = [LeaseResult(Outcome.RENEWED, None, "c", lease=lease)
                   for lease in renew.leases]
        assert schedule.renewed(renew, results, started, started + 1.5) == []
    last = schedule.slots[ident(2499)].state
    assert last is not None and last.deadline == pytest.approx(8.0 + 15 - 3.5)
    due = schedule.due(10.0)  # one renewal interval after the tick began
    assert [len(r.slots) for r in due.renewals] == [1000, 1000, 500]


def test_a_turn_that_fails_frees_what_it_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    from mos_lease.keep.turn import turn_failed

    rig = Rig()
    rig.add(3)
    rig.settle()
    schedule = rig.supervisor._core.schedule

    def broken(*_args: object) -> list[Change]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(schedule, "renewed", broken)
    rig.time.advance(11)
    with pytest.raises(RuntimeError):
        rig.supervisor.turn()
    assert all(slot.busy for slot in schedule.slots.values())  # claimed by the failed turn
    turn_failed(rig.supervisor._core, RuntimeError("a bug"))
    monkeypatch.undo()
    rig.run(2)
    assert not rig.of(BindingLost)
    assert all(slot.holding and not slot.busy for slot in schedule.slots.values())


# --- renewal batches in flight ---------------------------------------------------------------


def _held_core(n: int, clock: list[float] | None = None) -> Core:
    """A supervisor core holding ``n`` leases acquired at 0, all due at 10 (ttl 30); its
    clock reads ``clock[0]`` (given, the caller moves it on)."""
    clock = [0.0] if clock is None else clock
    clock[0] = 0.0
    core = Core(lambda: clock[0], lambda: 0.5, None)
    schedule = core.schedule
    for i in range(n):
        schedule.add(_binding(i), 0.0)
    _acquire_all(schedule, schedule.due(0.0))
    clock[0] = 10.0
    return core


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_turn_keeps_at_most_in_flight_batches_started_and_waits_within_the_deadline(
        in_flight: int) -> None:
    from mos_lease.keep.turn import Collect, turn

    core = _held_core(2500)
    earliest = core.schedule.earliest_deadline()
    flow = turn(core, in_flight)
    started: list[RenewalBatch] = []
    flying = 0
    kinds: list[str] = []
    answer: Any = None
    with pytest.raises(StopIteration):
        while True:
            call = flow.send(answer)
            if isinstance(call, RenewalBatch):
                flying += 1
                assert flying <= in_flight
                assert 10.0 + call.timeout <= earliest
                started.append(call)
                kinds.append("renew")
                answer = call  # the ticket
            else:
                assert isinstance(call, Collect)
                assert 10.0 + call.timeout <= earliest
                flying -= 1
                kinds.append("collect")
                renew = call.ticket
                assert isinstance(renew, RenewalBatch)
                answer = [LeaseResult(Outcome.RENEWED, None, "c", lease=lease)
                          for lease in renew.leases]
    expected = {1: ["renew", "collect"] * 3,
                2: ["renew", "renew", "collect", "renew", "collect", "collect"]}[in_flight]
    assert kinds == expected
    assert [len(r.slots) for r in started] == [1000, 1000, 500]
    assert all(not slot.busy and slot.holding for slot in core.schedule.slots.values())


def test_batches_in_flight_when_the_supervisor_closes_are_collected_and_judged() -> None:
    from mos_lease.keep.turn import Collect, turn

    core = _held_core(2500)
    flow = turn(core, 2)
    first = flow.send(None)
    assert isinstance(first, RenewalBatch)
    second = flow.send(first)
    assert isinstance(second, RenewalBatch)
    core.closing = True  # close() while two batches are in flight
    collect = flow.send(second)
    assert isinstance(collect, Collect) and collect.ticket is first
    collect = flow.send(StoreUnavailable("down"))  # judged: retried, not lost
    assert isinstance(collect, Collect) and collect.ticket is second
    with pytest.raises(StopIteration):
        flow.send([LeaseResult(Outcome.RENEWED, None, "c", lease=lease)
                   for lease in second.leases])
    # The third batch was never sent: its slots are given back, and nothing was lost.
    slots = core.schedule.slots.values()
    assert all(not slot.busy and slot.holding for slot in slots)
    assert sum(slot.state is not None and slot.state.failures == 1 for slot in slots) == 1000



@pytest.mark.parametrize("answer", ["ended in time", "plain, judged when collected"])
def test_a_batch_that_returned_in_time_is_judged_as_of_then_not_as_of_its_collection(
        answer: str) -> None:
    """Two batches in flight, collected in the order they started: the first hangs until the
    earliest deadline and is given up on (its leases lost); the second returned at once but
    is collected only then. Answered as :class:`Ended` (what both drivers answer), its leases
    are judged as of the time its call returned, and kept; a plain answer is judged as of its
    collection, past the deadline, and its leases are lost, although they were renewed."""
    from mos_lease.keep.turn import OVERDUE, Collect, Ended, turn

    clock = [0.0]
    core = _held_core(2000, clock)
    deadline = core.schedule.earliest_deadline()
    flow = turn(core, 2)
    first = flow.send(None)
    second = flow.send(first)
    assert isinstance(first, RenewalBatch) and isinstance(second, RenewalBatch)
    collect = flow.send(second)
    assert isinstance(collect, Collect) and collect.ticket is first
    clock[0] = deadline  # the first batch ran until the deadline
    collect = flow.send(OVERDUE)
    assert isinstance(collect, Collect) and collect.ticket is second
    results = [LeaseResult(Outcome.RENEWED, None, "c", lease=lease) for lease in second.leases]
    with pytest.raises(StopIteration):
        flow.send(Ended(results, 10.05) if answer == "ended in time" else results)
    slots = core.schedule.slots.values()
    held = {slot.binding.identity for slot in slots if slot.holding}
    assert held == ({lease.identity for lease in second.leases}
                    if answer == "ended in time" else set())
    assert sum(slot.state is not None and slot.state.loss is not None for slot in slots) == (
        2000 - len(held))

@pytest.mark.parametrize("lanes", [1, 2])
def test_a_batch_outpaced_on_another_coordinator_is_given_up_on_at_half_the_time_left(
        lanes: int) -> None:
    """Three batches, one in flight at a time, each waited for until the earliest deadline.
    Given a second renewal coordinator, each may be given up on sooner, at half the time
    left to the earliest deadline of its leases and of the batches behind it, if the other
    coordinator is outpacing it (its patience): then its own leases are retried (on the
    other coordinator), not lost, and the batches behind it are sent with time to spare. On
    one coordinator (busy with the hung call, it could not renew them sooner) a batch has no
    patience: the whole time to that deadline."""
    from mos_lease.keep.turn import OVERDUE, Collect, turn

    clock = [0.0]
    core = _held_core(3000, clock)
    deadline = core.schedule.earliest_deadline()
    flow = turn(core, 1, lanes)
    first = flow.send(None)
    assert isinstance(first, RenewalBatch)
    assert first.timeout == pytest.approx(deadline - 10.0)
    collect = flow.send(first)
    assert isinstance(collect, Collect) and collect.timeout == pytest.approx(first.timeout)
    assert collect.patience == pytest.approx(first.timeout / (2 if lanes > 1 else 1))
    if lanes == 1 or collect.patience is None:
        return
    clock[0] += collect.patience  # outpaced: given up on then
    second = flow.send(OVERDUE)
    assert isinstance(second, RenewalBatch) and second.timeout > 0
    assert all(s.state is not None and s.state.loss is None and s.state.failures == 1
               for s in first.slots)  # retried, with the time they have left
    collect = flow.send(second)
    answered = [LeaseResult(Outcome.RENEWED, None, "c", lease=lease) for lease in second.leases]
    last = flow.send(answered)
    assert isinstance(last, RenewalBatch)
    collect = flow.send(last)
    assert isinstance(collect, Collect)
    assert collect.patience == pytest.approx((deadline - clock[0]) / 2)


class _Overlapping(AsyncInMemoryLeaseStore):
    """Counts how many ``renew_many`` calls are running at once (each yields to the loop
    while it runs, as a real store's round trip would)."""

    def __init__(self, inner: InMemoryLeaseStore) -> None:
        super().__init__(inner)
        self.running = 0
        self.most = 0
        self.calls = 0

    async def renew_many(self, items: Any) -> list[WriteOutcome]:
        self.running += 1
        self.calls += 1
        self.most = max(self.most, self.running)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            return await super().renew_many(items)
        finally:
            self.running -= 1


def test_the_asyncio_supervisor_keeps_two_renewal_batches_in_flight() -> None:
    async def main() -> None:
        rig = AsyncRig(_Overlapping)
        time, store, changes, sleeps, supervisor = (
            rig.time, rig.store, rig.changes, rig.sleeps, rig.supervisor)
        tasks = 0
        for i in range(2500):
            supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
        before = len(asyncio.all_tasks())
        for _ in range(30):
            time.advance(0.5)
            start = len(sleeps)
            while len(sleeps) == start:
                turn = asyncio.ensure_future(supervisor.turn())
                while not turn.done():
                    tasks = max(tasks, len(asyncio.all_tasks()) - before)
                    await asyncio.sleep(0)
        assert store.calls == 3 and store.most == 2
        assert tasks <= 3  # the turn and two renewals (the benchmark's "tasks at once")
        assert not [c for c in changes if isinstance(c, BindingLost)]
        assert all(supervisor.lease(ident(i)) is not None for i in (0, 1500, 2499))
        await supervisor.close()

    asyncio.run(main())


def test_a_thread_supervisor_turn_that_fails_part_way_leaves_no_batch_to_start_later(
        ) -> None:
    """A turn that raised (a bug) after priming a batch it never started: the next turn
    starts only its own batches, and the renewals go on."""
    from mos_lease.keep.turn import Collect, turn_failed

    rig = Rig()
    rig.add(2500)
    rig.settle()
    perform = rig.supervisor._perform
    failures: list[Exception] = []

    def failing(call: object) -> object:
        if not failures and isinstance(call, Collect):
            failures.append(RuntimeError("a bug in the turn"))
            raise failures[0]
        return perform(call)  # type: ignore[arg-type]

    rig.supervisor._perform = failing  # type: ignore[method-assign]
    before = rig.store.calls.get("renew_many", 0)
    for _ in range(40):  # until the renewals are due and the turn fails at its first Collect
        rig.time.advance(0.5)
        try:
            rig.supervisor.turn()
        except RuntimeError as error:
            turn_failed(rig.supervisor._core, error)  # as the supervisor's thread does
            break
    assert failures, "the renewals never came due"
    assert rig.store.calls.get("renew_many", 0) == before + 1  # the second was only primed
    rig.supervisor._perform = perform  # type: ignore[method-assign]
    rig.settle()
    # Its own three batches, not the failed turn's leftover as well.
    assert rig.store.calls.get("renew_many", 0) == before + 1 + 3
    rig.run(12)
    assert not rig.of(BindingLost)
    assert all(rig.supervisor.lease(ident(i)) is not None for i in (0, 1500, 2499))


def test_the_thread_supervisor_primes_the_next_batch_while_one_store_call_runs() -> None:
    """Its thread budget: the supervisor's thread, one renewal thread, and the PostgreSQL
    store's watchdog. Two batches are in flight, but only their priming (checks, building)
    overlaps: the next batch is primed on the supervisor's thread while the last one's store
    call runs, and its call starts once that one was collected."""
    import threading

    rig = Rig()
    lock = threading.Lock()
    running = [0, 0]  # now, most
    renewal_threads: list[int] = []
    primed_while_running: list[int] = []
    primed = threading.Condition(lock)
    calls = [0]
    inner = rig.store.renew_many
    real_prime = rig.coordinator.prime_heartbeat_many

    def renew_many(items: Sequence[tuple[RenewWrite, AuditEntry]]) -> list[WriteOutcome]:
        with lock:
            running[0] += 1
            running[1] = max(running)
            calls[0] += 1
            call = calls[0]
        renewal_threads.append(sum(t.name == "mos-lease-supervisor-renewal"
                                   for t in threading.enumerate()))
        try:
            # Each call but the last waits (a while at most) for the next batch to be primed:
            # the overlap is then certain, however fast the in-memory store answers and
            # however the two threads are scheduled.
            if call < 3:
                with primed:
                    primed.wait_for(lambda: len(primed_while_running) > call, 5)
            return inner(items)
        finally:
            with lock:
                running[0] -= 1

    def prime(leases: Sequence[LeaseHandle], *, ttl: float | timedelta,
              correlation_id: str | None = None) -> Callable[[], list[LeaseResult]]:
        with primed:
            primed_while_running.append(running[0])
            primed.notify_all()
        return real_prime(leases, ttl=ttl, correlation_id=correlation_id)

    rig.store.renew_many = renew_many  # type: ignore[method-assign]
    rig.coordinator.prime_heartbeat_many = prime  # type: ignore[method-assign]
    rig.add(2500)
    rig.settle()
    rig.run(12)
    assert rig.store.calls.get("renew_many") == 3 and running[1] == 1
    assert primed_while_running[:3] == [0, 1, 1]  # the 2nd and 3rd primed during a call
    assert max(renewal_threads) == 1
    assert not rig.of(BindingLost)
    assert all(rig.supervisor.lease(ident(i)) is not None for i in (0, 1500, 2499))
