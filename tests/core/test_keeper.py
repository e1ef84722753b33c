"""Lease keepers: the pure schedule, and both drivers on an in-memory store with fake time."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from uuid import UUID

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    CommitOutcomeUnknown,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    Outcome,
    Reason,
    StoreUnavailable,
)
from mos_lease.clock import ManualClock
from mos_lease.keeper import (
    DEFAULT_CLOCK_STEP,
    AsyncLeaseKeeper,
    HeartbeatDue,
    KeeperState,
    KeeperTiming,
    LeaseKeeper,
    LeaseLoss,
    LossCause,
    ReportLoss,
    Wait,
    after_renewal,
    grant_loss,
    held,
    lose,
    next_action,
)
from mos_lease.machine import Renew, Write
from mos_lease.records import AuditEntry, Snapshot, WriteOutcome
from mos_lease.results import GrantResult, LeaseResult
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore

IDENT = LeaseIdentity("acme", "agent-1", "binding-1")
SCOPES = ("tool:run",)
START = datetime(2030, 1, 1, tzinfo=UTC)
TTL = 9.0  # renew every ~3 s, deadline 8.1 s after the start of the last success
HANDLE = LeaseHandle(IDENT, "conn-a", UUID(int=1), 1, SCOPES, START)
TIMING = KeeperTiming(TTL, clock_step=0)  # the schedule's own arithmetic: margin ttl / 10

# --- the pure schedule --------------------------------------------------------------------


def test_a_ttl_too_short_for_the_clock_step_is_refused_with_the_ways_out() -> None:
    with pytest.raises(ConfigurationError, match=r"ttl 3 s is too short .* clock_step=0"):
        KeeperTiming(3)
    assert KeeperTiming(3, clock_step=0).margin == pytest.approx(0.3)
    assert KeeperTiming(5).margin == pytest.approx(2.5)


def test_timing_defaults() -> None:
    # ttl / 10 for clock-rate drift, plus a 2 s step of database time across a failover.
    default = KeeperTiming(TTL)
    assert default.margin == pytest.approx(0.9 + DEFAULT_CLOCK_STEP) == pytest.approx(2.9)
    assert default.deadline(100.0) == pytest.approx(106.1)
    assert KeeperTiming(9, clock_step=0).margin == pytest.approx(0.9)
    assert KeeperTiming(9, safety_margin=0.5, clock_step=5).margin == 0.5
    assert TIMING.renew_delay(0.0) == pytest.approx(2.4)
    assert TIMING.renew_delay(0.5) == pytest.approx(3.0)
    assert TIMING.renew_delay(0.999999) == pytest.approx(3.6, abs=1e-4)


@pytest.mark.parametrize("options", [
    {"ttl": 0}, {"ttl": -1}, {"ttl": float("inf")}, {"ttl": True},
    {"ttl": 9, "renew_fraction": 0}, {"ttl": 9, "renew_fraction": 1},
    {"ttl": 9, "jitter": -0.1}, {"ttl": 9, "jitter": 1},
    {"ttl": 9, "safety_margin": 9}, {"ttl": 9, "safety_margin": -1},
    {"ttl": 9, "clock_step": -0.1}, {"ttl": 9, "clock_step": float("nan")},
    {"ttl": 9, "clock_step": True},
    {"ttl": 9, "min_backoff": 0}, {"ttl": 9, "min_backoff": 3, "max_backoff": 2},
    # the latest first renewal (0.8 * 1.2 * ttl) would come after the deadline (0.9 * ttl)
    {"ttl": 9, "renew_fraction": 0.8},
])
def test_timing_refuses_unsafe_options(options: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        KeeperTiming(**options)


def test_schedule_wait_renew_lose() -> None:
    state = held(TIMING, HANDLE, 100.0, 0.5)
    assert next_action(state, 100.0) == Wait(103.0)
    assert next_action(state, 103.0) == HeartbeatDue(state.deadline)
    lost = next_action(state, 108.1)
    assert isinstance(lost, ReportLoss)
    assert lost.loss.cause is LossCause.DEADLINE
    assert lost.loss.reason is Reason.LEASE_EXPIRED


def test_deadline_counts_from_the_start_of_the_renewal() -> None:
    state = held(TIMING, HANDLE, 100.0, 0.5)
    renewed = attrs.evolve(HANDLE, expires_at=START)
    ok = LeaseResult(Outcome.RENEWED, None, "c", lease=renewed)
    # A renewal that took 2 s: the store's expiry was set somewhere in those 2 s, so the
    # only safe base is the moment it started.
    after = after_renewal(state, TIMING, 103.0, 105.0, ok, 0.5)
    assert after.deadline == pytest.approx(103.0 + TTL - 0.9)
    assert after.renew_at == pytest.approx(106.0)
    assert after.lease is renewed
    assert after.loss is None


def test_success_after_the_deadline_is_still_loss() -> None:
    state = held(TIMING, HANDLE, 100.0, 0.5)
    ok = LeaseResult(Outcome.RENEWED, None, "c", lease=HANDLE)
    after = after_renewal(state, TIMING, 107.0, 108.2, ok, 0.5)
    assert after.loss is not None and after.loss.cause is LossCause.DEADLINE


@pytest.mark.parametrize("reason", [Reason.STALE_EPOCH, Reason.LEASE_EXPIRED,
                                    Reason.LEASE_REPLACED, Reason.POLICY_DENIED])
def test_a_refusal_is_definite_loss_at_once(reason: Reason) -> None:
    state = held(TIMING, HANDLE, 100.0, 0.5)
    denied = LeaseResult(Outcome.DENIED, reason, "c")
    after = after_renewal(state, TIMING, 103.0, 103.01, denied, 0.5)
    assert after.loss == LeaseLoss(LossCause.DENIED, reason, 103.01)


@pytest.mark.parametrize("error", [StoreUnavailable("down"),
                                   CommitOutcomeUnknown(UUID(int=9), "lost")])
def test_a_transient_error_is_not_loss(error: Exception) -> None:
    state = held(TIMING, HANDLE, 100.0, 0.5)
    after = after_renewal(state, TIMING, 103.0, 103.5, error, 0.5)
    assert after.loss is None
    assert after.failures == 1
    assert after.last_error is not None and type(error).__name__ in after.last_error
    assert 103.5 < after.renew_at < after.deadline
    assert after.deadline == state.deadline  # a failure never extends anything


def test_an_unexpected_error_fails_closed() -> None:
    state = held(TIMING, HANDLE, 100.0, 0.5)
    after = after_renewal(state, TIMING, 103.0, 103.5, RuntimeError("bug"), 0.5)
    assert after.loss is not None and after.loss.cause is LossCause.ERROR
    assert after.loss.error == "RuntimeError: bug"


def test_loss_is_final() -> None:
    state = lose(held(TIMING, HANDLE, 100.0, 0.5),
                 LeaseLoss(LossCause.DENIED, Reason.STALE_EPOCH, 101.0))
    ok = LeaseResult(Outcome.RENEWED, None, "c", lease=HANDLE)
    assert after_renewal(state, TIMING, 101.0, 101.1, ok, 0.5) is state
    assert lose(state, LeaseLoss(LossCause.STOPPED, Reason.LEASE_RELEASED, 102.0)) is state
    assert next_action(state, 101.5) == ReportLoss(state.loss)  # type: ignore[arg-type]


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=60))
def test_transient_errors_retry_until_exactly_the_deadline(
        draws: list[tuple[float, float]]) -> None:
    """Whatever the timing of failures, the keeper neither gives up before the deadline
    nor carries on past it, and keeps trying in between."""
    state: KeeperState = held(TIMING, HANDLE, 0.0, 0.5)
    now = state.renew_at
    for call_time, draw in draws:
        action = next_action(state, now)
        if now >= state.deadline:
            assert isinstance(action, ReportLoss)
            return
        assert isinstance(action, HeartbeatDue | Wait)
        if isinstance(action, Wait):
            assert action.until <= state.deadline
            now = action.until
            continue
        finished = now + call_time * (state.deadline - now) * 0.5
        state = after_renewal(state, TIMING, now, finished, StoreUnavailable("x"), draw)
        assert state.loss is None
        assert finished <= state.renew_at <= max(finished, state.deadline)
        assert state.renew_at - finished <= TIMING.max_backoff


@given(st.integers(1, 200), st.floats(0, 1), st.floats(0, 100))
def test_backoff_bounds(failures: int, draw: float, remaining: float) -> None:
    delay = TIMING.backoff(failures, draw, remaining)
    assert 0 <= delay <= TIMING.max_backoff
    assert delay <= max(remaining / 2, min(TIMING.min_backoff, remaining))


def test_grant_loss_only_for_lease_state_reasons() -> None:
    for reason in (Reason.STALE_EPOCH, Reason.LEASE_RELEASED, Reason.LEASE_MISSING,
                   Reason.EPOCH_MISMATCH, Reason.LEASE_REPLACED, Reason.LEASE_EXPIRED):
        loss = grant_loss(GrantResult(Outcome.DENIED, reason, "c"), 5.0)
        assert loss == LeaseLoss(LossCause.DENIED, reason, 5.0)
    for reason in (Reason.SCOPE_NOT_AUTHORIZED, Reason.POLICY_DENIED,
                   Reason.TTL_NOT_AUTHORIZED):
        assert grant_loss(GrantResult(Outcome.DENIED, reason, "c"), 5.0) is None


# --- drivers on an in-memory store with fake time -----------------------------------------


class FakeTime:
    """One fake timeline for the keeper's monotonic clock and the store's clock."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.store_clock = ManualClock(START)

    def clock(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.store_clock.advance(seconds)

    async def async_sleep(self, seconds: float) -> None:
        self.advance(seconds)


class Faulty:
    """An ``InMemoryLeaseStore`` wrapper whose calls fail as ``mode`` says.

    ``down``: every call raises ``StoreUnavailable``; ``unknown``: writes lose their commit
    outcome and the reconciling read fails too; ``boom``: ``RuntimeError``; ``slow``: each
    call takes ``delay`` seconds of fake time; ``hang``: calls block until ``release``.
    """

    def __init__(self, inner: InMemoryLeaseStore, time_: FakeTime | None = None) -> None:
        self.inner = inner
        self.time = time_
        self.mode: str | None = None
        self.delay = 0.0
        self.calls = 0
        self.release = threading.Event()

    def _enter(self, write: bool = False) -> None:
        self.calls += 1
        if self.mode == "down":
            raise StoreUnavailable("connection refused")
        if self.mode == "unknown" and write:
            raise CommitOutcomeUnknown(UUID(int=0), "connection dropped")
        if self.mode == "unknown":
            raise StoreUnavailable("still down")
        if self.mode == "boom":
            raise RuntimeError("driver bug")
        if self.mode == "slow" and self.time is not None:
            self.time.advance(self.delay)
        if self.mode == "hang":
            self.release.wait(30)

    def load(self, identity: LeaseIdentity) -> Snapshot:
        self._enter()
        return self.inner.load(identity)

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        self._enter(write=True)
        return self.inner.apply(write, entry)

    def renew_many(self, items: Sequence[tuple[Renew, AuditEntry]]) -> list[WriteOutcome]:
        return [self.apply(write, entry) for write, entry in items]

    def record(self, entry: AuditEntry) -> None:
        self._enter()
        self.inner.record(entry)

    def record_many(self, entries: Sequence[AuditEntry]) -> None:
        self._enter()
        self.inner.record_many(entries)

    def event_committed(self, event_id: UUID) -> bool:
        self._enter()
        return self.inner.event_committed(event_id)


class AsyncFaulty:
    def __init__(self, sync: Faulty) -> None:
        self.sync = sync
        self.hang = asyncio.Event()

    async def _maybe_hang(self) -> None:
        if self.sync.mode == "hang":
            await self.hang.wait()

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        await self._maybe_hang()
        return self.sync.load(identity)

    async def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        await self._maybe_hang()
        return self.sync.apply(write, entry)

    async def renew_many(self, items: Sequence[tuple[Renew, AuditEntry]]
                         ) -> list[WriteOutcome]:
        await self._maybe_hang()
        return self.sync.renew_many(items)

    async def record(self, entry: AuditEntry) -> None:
        await self._maybe_hang()
        self.sync.record(entry)

    async def record_many(self, entries: Sequence[AuditEntry]) -> None:
        await self._maybe_hang()
        self.sync.record_many(entries)

    async def event_committed(self, event_id: UUID) -> bool:
        await self._maybe_hang()
        return self.sync.event_committed(event_id)


@attrs.define
class Rig:
    time: FakeTime
    store: InMemoryLeaseStore
    faulty: Faulty
    coordinator: ConnectorLeaseCoordinator
    losses: list[LeaseLoss]

    def keeper(self, **options: object) -> LeaseKeeper:
        kw: dict[str, object] = {"ttl": TTL, "clock": self.time.clock,
                                 "sleep": self.time.advance, "random": lambda: 0.5,
                                 "background": False, "on_lost": self.losses.append,
                                 "clock_step": 0}
        kw.update(options)
        return LeaseKeeper(self.coordinator, **kw)  # type: ignore[arg-type]

    def other(self) -> ConnectorLeaseCoordinator:
        """A second gateway on the same store, without faults."""
        return ConnectorLeaseCoordinator(self.store, AllowAllPolicy())

    def events(self, event: LifecycleEvent) -> int:
        return sum(1 for r in self.store.audit(limit=10**6) if r.entry.event is event)


def make_rig() -> Rig:
    time_ = FakeTime()
    store = InMemoryLeaseStore(time_.store_clock)
    faulty = Faulty(store, time_)
    return Rig(time_, store, faulty, ConnectorLeaseCoordinator(faulty, AllowAllPolicy()), [])


def test_keeper_renews_on_schedule() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert rig.keeper().lease is None
    result = keeper.acquire(IDENT, "conn-a", scopes=SCOPES)
    assert result.ok and keeper.lease == result.lease
    assert keeper.deadline == pytest.approx(1000.0 + TTL - 0.9)
    assert keeper.step() == Wait(1003.0)
    assert isinstance(keeper.step(), HeartbeatDue)
    assert rig.events(LifecycleEvent.HEARTBEAT) == 1
    assert keeper.deadline == pytest.approx(1003.0 + TTL - 0.9)
    lease = keeper.lease
    assert lease is not None and lease.expires_at == START.replace(second=12)
    for _ in range(20):  # 30 s of fake time: ten renewals, never lost
        keeper.step()
    assert rig.events(LifecycleEvent.HEARTBEAT) == 11
    assert not keeper.lost.is_set() and rig.losses == []
    grant = keeper.issue_grant(scopes=SCOPES, ttl=5)
    assert grant.ok


@pytest.mark.parametrize("mode", ["down", "unknown"])
def test_outage_is_loss_exactly_at_the_deadline(mode: str) -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    deadline = keeper.deadline
    assert deadline is not None
    rig.faulty.mode = mode
    attempts = 0
    while not keeper.lost.is_set():
        action = keeper.step()
        if isinstance(action, HeartbeatDue):
            attempts += 1
        # Never reported lost while the deadline is still ahead (and the next step after
        # reaching it reports it, as the final time check below shows).
        assert not keeper.lost.is_set() or rig.time.mono >= deadline
    assert attempts >= 5  # kept retrying with backoff, not one try and give up
    assert rig.time.mono == pytest.approx(deadline)
    assert keeper.loss is not None and keeper.loss.cause is LossCause.DEADLINE
    assert keeper.loss.error is not None
    assert rig.losses == [keeper.loss] and keeper.lease is None
    # Refuses locally, without asking the (unreachable) store.
    calls = rig.faulty.calls
    refused = keeper.issue_grant(scopes=SCOPES, ttl=5)
    assert (refused.outcome, refused.reason) == (Outcome.DENIED, Reason.LEASE_EXPIRED)
    assert rig.faulty.calls == calls


def test_recovery_before_the_deadline_keeps_the_lease() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    rig.faulty.mode = "down"
    while rig.time.mono < 1006.0:
        keeper.step()
    rig.faulty.mode = None
    while rig.events(LifecycleEvent.HEARTBEAT) == 0:
        keeper.step()
    assert not keeper.lost.is_set()
    state_deadline = keeper.deadline
    assert state_deadline is not None and state_deadline > 1006.0 + TTL - 1.0


def test_a_takeover_is_noticed_at_the_next_heartbeat() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    other = rig.other()
    # Preempt (allowed by this test's policy) while conn-a still holds the lease.
    assert other.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60, expected_epoch=1).ok
    while not keeper.lost.is_set():
        keeper.step()
    assert keeper.loss == LeaseLoss(LossCause.DENIED, Reason.STALE_EPOCH, 1003.0)
    assert rig.time.mono == 1003.0  # at the first renewal, long before the deadline


def test_a_refused_grant_reveals_loss() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    assert rig.other().takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60, expected_epoch=1).ok
    denied = keeper.issue_grant(scopes=SCOPES, ttl=5)
    assert denied.reason is Reason.STALE_EPOCH
    assert keeper.lost.is_set() and rig.losses[0].reason is Reason.STALE_EPOCH
    # A refusal that says nothing about the lease is not loss.
    rig2 = make_rig()
    keeper2 = rig2.keeper()
    assert keeper2.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    wider = keeper2.issue_grant(scopes=["tool:admin"], ttl=5)
    assert wider.reason is Reason.SCOPE_NOT_AUTHORIZED and not keeper2.lost.is_set()


def test_no_grant_after_the_deadline_even_if_the_store_would_mint_one() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    # The heartbeat thread starved (no steps) and local time passed the deadline, but the
    # store's lease (ttl 9 s) is still active at 8.5 s.
    rig.time.advance(8.5)
    issued = rig.events(LifecycleEvent.GRANT_ISSUE)
    refused = keeper.issue_grant(scopes=SCOPES, ttl=5)
    assert refused.reason is Reason.LEASE_EXPIRED and keeper.lost.is_set()
    assert rig.events(LifecycleEvent.GRANT_ISSUE) == issued  # not even asked


def test_a_grant_whose_issue_outlasted_the_deadline_is_withheld() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    rig.time.advance(7.0)
    rig.faulty.mode, rig.faulty.delay = "slow", 0.6  # load + record: 1.2 s in the store
    refused = keeper.issue_grant(scopes=SCOPES, ttl=5)
    assert rig.events(LifecycleEvent.GRANT_ISSUE) == 1  # the store did mint one ...
    assert refused.reason is Reason.LEASE_EXPIRED  # ... but it is not handed out
    assert refused.grant is None


def test_store_errors_on_grant_issue_propagate_before_the_deadline() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    rig.faulty.mode = "down"
    with pytest.raises(StoreUnavailable):
        keeper.issue_grant(scopes=SCOPES, ttl=5)
    assert not keeper.lost.is_set()


def test_unexpected_errors_fail_closed() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    rig.faulty.mode = "boom"
    keeper.step()
    keeper.step()
    assert keeper.loss is not None and keeper.loss.cause is LossCause.ERROR
    assert keeper.loss.error is not None and "driver bug" in keeper.loss.error


def test_stop_releases_and_signals() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.stop() is None  # nothing held yet
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    released = keeper.stop()
    assert released is not None and released.outcome is Outcome.RELEASED
    assert keeper.lost.is_set()
    assert [loss.cause for loss in rig.losses] == [LossCause.STOPPED]
    assert keeper.issue_grant(scopes=SCOPES, ttl=5).reason is Reason.LEASE_RELEASED
    assert keeper.stop() is None  # idempotent
    assert rig.other().takeover(IDENT, "conn-b", scopes=SCOPES, ttl=9, expected_epoch=1).ok


def test_stop_after_loss_does_not_release() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    rig.time.advance(20)
    assert keeper.enforce_deadline() is not None
    assert keeper.stop() is None
    assert rig.events(LifecycleEvent.RELEASE) == 0
    assert [loss.cause for loss in rig.losses] == [LossCause.DEADLINE]


def test_a_keeper_keeps_one_lease() -> None:
    rig = make_rig()
    assert rig.other().acquire(IDENT, "conn-z", scopes=SCOPES, ttl=5).ok
    keeper = rig.keeper()
    with pytest.raises(InvalidInput, match="holds no lease"):
        keeper.issue_grant(scopes=SCOPES, ttl=1)
    held_elsewhere = keeper.acquire(IDENT, "conn-a", scopes=SCOPES)
    assert held_elsewhere.reason is Reason.LEASE_HELD and keeper.lease is None
    rig.time.advance(6)
    taken = keeper.takeover(IDENT, "conn-a", scopes=SCOPES, expected_epoch=1)
    assert taken.ok and keeper.lease is not None and keeper.lease.epoch == 2
    with pytest.raises(InvalidInput, match="one lease"):
        keeper.acquire(IDENT, "conn-a", scopes=SCOPES)


def test_adopt_uses_the_given_start() -> None:
    rig = make_rig()
    before = rig.time.clock()
    result = rig.coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=TTL)
    assert result.lease is not None
    rig.time.advance(2)
    keeper = rig.keeper()
    keeper.adopt(result.lease, obtained_at=before)
    assert keeper.deadline == pytest.approx(before + TTL - 0.9)
    with pytest.raises(InvalidInput):
        rig.keeper().adopt("lease", obtained_at=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["down", "boom"])
def test_a_start_whose_call_raises_leaves_the_keeper_free_to_try_again(mode: str) -> None:
    rig = make_rig()
    keeper = rig.keeper()
    rig.faulty.mode = mode
    with pytest.raises((StoreUnavailable, RuntimeError)):
        keeper.acquire(IDENT, "conn-a", scopes=SCOPES)
    assert keeper.lease is None and keeper.loss is None
    rig.faulty.mode = None
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok and keeper.lease is not None


def test_a_cancelled_async_start_leaves_the_keeper_free_to_try_again() -> None:
    async def scenario() -> None:
        time_, faulty, coordinator, _ = _async_rig()
        keeper = AsyncLeaseKeeper(coordinator, clock_step=0, ttl=TTL, clock=time_.clock,
                                  sleep=time_.async_sleep, background=False)
        faulty.mode = "hang"
        starting = asyncio.ensure_future(keeper.acquire(IDENT, "conn-a", scopes=SCOPES))
        for _ in range(5):
            await asyncio.sleep(0)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        assert keeper.lease is None
        faulty.mode = None
        assert (await keeper.acquire(IDENT, "conn-a", scopes=SCOPES)).ok
        assert keeper.lease is not None

    asyncio.run(scenario())


def test_a_failing_callback_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig()

    def explode(_loss: LeaseLoss) -> None:
        raise RuntimeError("callback bug")

    keeper = rig.keeper(on_lost=explode)
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    rig.time.advance(20)
    with caplog.at_level(logging.WARNING, logger="mos_lease.keeper"):
        assert keeper.enforce_deadline() is not None
    assert keeper.lost.is_set()
    assert "on_lost callback failed" in caplog.text


# --- real threads and real time -----------------------------------------------------------


def _real_rig() -> tuple[InMemoryLeaseStore, Faulty, ConnectorLeaseCoordinator]:
    store = InMemoryLeaseStore()  # system clock
    faulty = Faulty(store)
    return store, faulty, ConnectorLeaseCoordinator(faulty, AllowAllPolicy())


def test_background_thread_renews_and_a_hung_store_is_loss_on_time() -> None:
    store, faulty, coordinator = _real_rig()
    losses: list[LeaseLoss] = []
    keeper = LeaseKeeper(coordinator, clock_step=0,
                         ttl=0.6, clock=time.monotonic, on_lost=losses.append)
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    time.sleep(0.9)
    beats = sum(1 for r in store.audit() if r.entry.event is LifecycleEvent.HEARTBEAT)
    assert beats >= 3 and not keeper.lost.is_set()
    faulty.mode = "hang"  # the next heartbeat blocks (a black-holed connection)
    hung_from = time.monotonic()
    try:
        assert keeper.lost.wait(2.0)
        loss = keeper.loss
        assert loss is not None and loss.cause is LossCause.DEADLINE
        # Reported by the deadline (at most ttl - margin = 0.54 s after the start of the
        # last success) plus scheduling slack, not whenever the hung call returns.
        assert loss.at - hung_from < 0.54 + 0.5
    finally:
        faulty.release.set()
    assert keeper.stop() is None
    assert len(losses) == 1  # the callback ran once (after ``lost`` was set)


def test_callback_may_stop_the_keeper_from_its_own_thread() -> None:
    _, faulty, coordinator = _real_rig()
    done = threading.Event()
    keeper: LeaseKeeper | None = None

    def on_lost(_loss: LeaseLoss) -> None:
        assert keeper is not None
        keeper.stop()
        done.set()

    keeper = LeaseKeeper(coordinator, clock_step=0, ttl=0.3, on_lost=on_lost)
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    faulty.mode = "down"
    assert done.wait(2.0)


# --- asyncio ------------------------------------------------------------------------------


def _async_rig() -> tuple[FakeTime, Faulty, AsyncConnectorLeaseCoordinator, InMemoryLeaseStore]:
    time_ = FakeTime()
    store = InMemoryLeaseStore(time_.store_clock)
    faulty = Faulty(store, time_)
    coordinator = AsyncConnectorLeaseCoordinator(AsyncFaulty(faulty), AllowAllPolicy())
    return time_, faulty, coordinator, store


def test_async_keeper_schedule_and_outage() -> None:
    async def scenario() -> None:
        time_, faulty, coordinator, _ = _async_rig()
        losses: list[LeaseLoss] = []
        keeper = AsyncLeaseKeeper(coordinator, clock_step=0, ttl=TTL, clock=time_.clock,
                                  sleep=time_.async_sleep, random=lambda: 0.5,
                                  background=False, on_lost=losses.append)
        assert (await keeper.acquire(IDENT, "conn-a", scopes=SCOPES)).ok
        assert await keeper.step() == Wait(1003.0)
        assert isinstance(await keeper.step(), HeartbeatDue)
        assert keeper.deadline == pytest.approx(1003.0 + TTL - 0.9)
        assert (await keeper.issue_grant(scopes=SCOPES, ttl=5)).ok
        faulty.mode = "down"
        while not keeper.lost.is_set():
            await keeper.step()
            assert not keeper.lost.is_set() or time_.mono >= 1003.0 + TTL - 0.9
        assert time_.mono == pytest.approx(1003.0 + TTL - 0.9)
        await asyncio.wait_for(keeper.lost.wait(), 1)
        assert losses[0].cause is LossCause.DEADLINE and keeper.lease is None
        calls = faulty.calls
        refused = await keeper.issue_grant(scopes=SCOPES, ttl=5)
        assert refused.reason is Reason.LEASE_EXPIRED and faulty.calls == calls
        assert await keeper.stop() is None

    asyncio.run(scenario())


def test_async_keeper_denial_and_release() -> None:
    async def scenario() -> None:
        time_, _, coordinator, store = _async_rig()
        keeper = AsyncLeaseKeeper(coordinator, clock_step=0, ttl=TTL, clock=time_.clock,
                                  sleep=time_.async_sleep, random=lambda: 0.5,
                                  background=False)
        assert (await keeper.takeover(IDENT, "conn-a", scopes=SCOPES,
                                      expected_epoch=1)).reason is Reason.LEASE_MISSING
        assert (await keeper.acquire(IDENT, "conn-a", scopes=SCOPES)).ok
        other = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        assert other.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60, expected_epoch=1).ok
        while not keeper.lost.is_set():
            await keeper.step()
        assert keeper.loss is not None and keeper.loss.reason is Reason.STALE_EPOCH

        keeper2 = AsyncLeaseKeeper(coordinator, clock_step=0, ttl=TTL, clock=time_.clock,
                                   sleep=time_.async_sleep, background=False)
        time_.advance(61)
        assert (await keeper2.takeover(IDENT, "conn-a", scopes=SCOPES, expected_epoch=2)).ok
        released = await keeper2.stop()
        assert released is not None and released.ok
        assert keeper2.loss is not None and keeper2.loss.cause is LossCause.STOPPED

    asyncio.run(scenario())


def test_async_background_task_and_hung_heartbeat() -> None:
    async def scenario() -> None:
        store = InMemoryLeaseStore()
        faulty = Faulty(store)
        wrapped = AsyncFaulty(faulty)
        coordinator = AsyncConnectorLeaseCoordinator(wrapped, AllowAllPolicy())
        keeper = AsyncLeaseKeeper(coordinator, clock_step=0, ttl=0.6)
        assert (await keeper.acquire(IDENT, "conn-a", scopes=SCOPES)).ok
        await asyncio.sleep(0.9)
        beats = sum(1 for r in store.audit() if r.entry.event is LifecycleEvent.HEARTBEAT)
        assert beats >= 3 and not keeper.lost.is_set()
        faulty.mode = "hang"
        hung_from = time.monotonic()
        await asyncio.wait_for(keeper.lost.wait(), 2.0)
        assert time.monotonic() - hung_from < 0.54 + 0.5
        assert keeper.loss is not None and keeper.loss.cause is LossCause.DEADLINE
        assert keeper.loss.error == "heartbeat still running at the deadline"
        assert await keeper.stop() is None

    asyncio.run(scenario())


def test_async_stop_cancels_the_renewal_task() -> None:
    async def scenario() -> None:
        coordinator = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(),
                                                     AllowAllPolicy())
        keeper = AsyncLeaseKeeper(coordinator, clock_step=0, ttl=5)
        assert (await keeper.acquire(IDENT, "conn-a", scopes=SCOPES)).ok
        task = keeper._task
        assert task is not None and not task.done()
        result = await keeper.stop()
        assert result is not None and result.ok and task.done()

    asyncio.run(scenario())



def test_enforce_deadline_records_a_passed_deadline_as_loss() -> None:
    rig = make_rig()
    keeper = rig.keeper()
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    assert keeper.enforce_deadline() is None
    rig.time.advance(20)
    loss = keeper.enforce_deadline()
    assert loss is not None and loss.cause is LossCause.DEADLINE
    assert keeper.loss == loss  # recorded, not merely looked at
    # No release ever exported ``check()``, its former name: no shim is kept for it.
    assert not hasattr(keeper, "check")


def test_a_keeper_takes_a_coordinator_of_its_own_kind_only() -> None:
    sync = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    asynchronous = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
    with pytest.raises(ConfigurationError, match="use AsyncLeaseKeeper with it"):
        LeaseKeeper(asynchronous, ttl=TTL)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="use LeaseKeeper with it"):
        AsyncLeaseKeeper(sync, ttl=TTL)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="LeaseKeeper needs a ConnectorLeaseCoord"):
        LeaseKeeper(object(), ttl=TTL)  # type: ignore[arg-type]
