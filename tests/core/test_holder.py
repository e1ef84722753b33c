"""``hold()`` and ``current_holder()`` on the in-memory store.

Waiting runs on fake time (one timeline for the holder's monotonic clock and the store's
clock, moved by the holder's injected sleep), so waits of minutes take no time. Loss while
holding runs on real time with leases of a fraction of a second, since the point there is
how soon the body hears of it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    ConnectorLeaseService,
    InvalidInput,
    LeaseIdentity,
    LeaseLoss,
    LeaseLost,
    LeaseNotAcquired,
    LossCause,
    Outcome,
    Reason,
    StaticConnectorPolicy,
    TakeoverPolicy,
    hold,
)
from mos_lease.holder import (
    HoldCallbacks,
    HoldTiming,
    expiring_check,
    pause_for,
)
from mos_lease.keeper import KeeperTiming
from mos_lease.records import AuditRecord
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState, LifecycleEvent
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.core.test_keeper import AsyncFaulty, FakeTime, Faulty

IDENT = LeaseIdentity("acme", "agent-1", "binding-1")
SCOPES = ("tool:run",)
ALLOW: ConnectorLeaseService = AllowAllPolicy()


def rules(preempt: bool, connector_id: str = "*") -> ConnectorLeaseService:
    return StaticConnectorPolicy.from_dict({"rules": [{
        "tenant_id": "acme", "logical_agent_id": "*", "binding_id": "*",
        "connector_id": connector_id, "scopes": list(SCOPES), "max_lease_ttl": 300,
        "max_grant_ttl": 30, "preempt_active": preempt}]})


def audit_of(store: InMemoryLeaseStore, connector_id: str | None = None) -> list[AuditRecord]:
    return [r for r in store.audit(limit=10**6)
            if connector_id is None or r.entry.connector_id == connector_id]


def rows(store: InMemoryLeaseStore) -> list[tuple[str, int, bool]]:
    return [(r.connector_id, r.epoch, r.released_at is not None) for r in store.leases()]


@attrs.define
class Sim:
    """A store on fake time, a coordinator for the waiter and one for a rival gateway.

    ``sleep`` is what the holder pauses with: it records the pause, runs the scheduled
    events due by then (the rival's doings) and moves the timeline."""

    time: FakeTime
    store: InMemoryLeaseStore
    faulty: Faulty
    waiter: ConnectorLeaseCoordinator
    rival: ConnectorLeaseCoordinator
    pauses: list[float] = attrs.Factory(list)
    max_pauses: int = 10_000
    after_pause: Callable[[], None] | None = None

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        assert len(self.pauses) <= self.max_pauses, "the waiter never stops waiting"
        assert seconds >= 0
        self.time.advance(seconds)
        if self.after_pause is not None:
            self.after_pause()

    def hold(self, **options: Any) -> Any:
        # One database host and no failover: clock_step 0 unless the test says otherwise.
        timing = options.pop("timing", HoldTiming())
        if timing.clock_step is None:
            timing = attrs.evolve(timing, clock_step=0)
        kw: dict[str, Any] = {"scopes": SCOPES, "ttl": 10, "clock": self.time.clock,
                              "sleep": self.sleep, "random": lambda: 0.5, "timing": timing}
        kw.update(options)
        return hold(self.waiter, IDENT, kw.pop("connector_id", "conn-b"), **kw)


def make_sim(policy: ConnectorLeaseService = ALLOW) -> Sim:
    fake = FakeTime()
    store = InMemoryLeaseStore(fake.store_clock)
    faulty = Faulty(store, fake)
    return Sim(fake, store, faulty, ConnectorLeaseCoordinator(faulty, policy),
               ConnectorLeaseCoordinator(store, ALLOW))


# --- current_holder ---------------------------------------------------------------------------


def test_current_holder_reads_without_writing_and_without_secrets() -> None:
    sim = make_sim()
    assert sim.waiter.current_holder(IDENT) is None
    lease = sim.rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10).lease
    assert lease is not None
    before = audit_of(sim.store)
    view = sim.waiter.current_holder(IDENT)
    assert view == HolderView("conn-a", 1, LeaseState.ACTIVE, lease.expires_at,
                              sim.time.store_clock.now())
    sim.time.advance(10)
    view = sim.waiter.current_holder(IDENT)
    assert view is not None and view.state is LeaseState.EXPIRED
    assert audit_of(sim.store) == before  # reads write no audit row
    # Nothing in a view can act on the lease or reveal what it allows.
    assert {f.name for f in attrs.fields(HolderView)} == {
        "connector_id", "epoch", "state", "expires_at", "now", "metadata", "metadata_invalid"}
    for secret in ("lease_id", "scopes"):
        assert not hasattr(view, secret)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        view.epoch = 5  # type: ignore[misc]
    with pytest.raises(InvalidInput):
        sim.waiter.current_holder("acme/agent-1/binding-1")  # type: ignore[arg-type]


def test_async_current_holder_matches() -> None:
    async def scenario() -> None:
        store = InMemoryLeaseStore()
        coordinator = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(store), ALLOW)
        assert await coordinator.current_holder(IDENT) is None
        await coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
        released = await coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
        assert released.reason is Reason.LEASE_HELD
        count = len(audit_of(store))
        view = await coordinator.current_holder(IDENT)
        assert view is not None and (view.connector_id, view.epoch, view.state) == (
            "conn-a", 1, LeaseState.ACTIVE)
        assert len(audit_of(store)) == count

    asyncio.run(scenario())


# --- the pure decisions -----------------------------------------------------------------------


def view(state: LeaseState, epoch: int = 4, left: float = 3.0) -> HolderView:
    now = FakeTime().store_clock.now()
    return HolderView("conn-a", epoch, state, now + timedelta(seconds=left), now)


def test_pause_backs_off_and_wakes_at_the_observed_expiry() -> None:
    timing = KeeperTiming(10, min_backoff=0.1, max_backoff=1.6)
    # Exponential, equal jitter (draw 0 gives half the base, draw ~1 the whole), capped.
    assert [pause_for(timing, n, 0.0, None, None) for n in range(1, 7)] == pytest.approx(
        [0.05, 0.1, 0.2, 0.4, 0.8, 0.8])
    assert pause_for(timing, 5, 0.999999, None, None) == pytest.approx(1.6, rel=1e-5)
    # Never past the end of the wait, never past the moment the seen lease expires.
    assert pause_for(timing, 5, 0.999999, 0.3, None) <= 0.3
    assert pause_for(timing, 5, 0.999999, None, view(LeaseState.ACTIVE, left=0.25)) == 0.25
    assert pause_for(timing, 5, 0.5, None, view(LeaseState.ACTIVE, left=-1)) == 0.0


def test_expiring_check() -> None:
    assert expiring_check(10.0, 5.0, 2.0) == (None, 3.0)
    assert expiring_check(10.0, 8.5, 2.0) == (1.5, 1.5)
    assert expiring_check(10.0, 10.5, 2.0) == (0.0, 0.01)


# --- waiting, on fake time --------------------------------------------------------------------


def test_free_identity_is_one_acquire_and_released_on_exit() -> None:
    sim = make_sim()
    calls: list[tuple[str, tuple[object, ...]]] = []

    def note(name: str) -> Callable[..., None]:
        return lambda *args: calls.append((name, args))

    told = HoldCallbacks(on_started=note("started"), on_stopped=note("stopped"),
                         on_new_holder=note("new_holder"), on_lost=note("lost"))
    with sim.hold(callbacks=told) as held:
        assert held.lease.epoch == 1 and held.lost is None
        assert held.issue_grant(scopes=SCOPES, ttl=5).ok
    assert [(r.entry.event, r.entry.outcome) for r in audit_of(sim.store)] == [
        (LifecycleEvent.ACQUIRE, Outcome.ACQUIRED),
        (LifecycleEvent.GRANT_ISSUE, Outcome.GRANT_ISSUED),
        (LifecycleEvent.RELEASE, Outcome.RELEASED)]
    assert rows(sim.store) == [("conn-b", 1, True)]
    assert [name for name, _ in calls] == ["new_holder", "started", "stopped"]
    assert calls[0][1] == ("conn-b", 1)
    assert sim.pauses == []
    assert held.lost is None  # a clean exit is not a loss
    with pytest.raises(LeaseLost):
        _ = held.lease  # but the lease is no longer there to use


def test_waiter_takes_over_an_expired_lease_at_the_epoch_it_saw() -> None:
    sim = make_sim()
    first = sim.rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30).lease
    assert first is not None
    holders: list[tuple[str, int]] = []
    told = HoldCallbacks(on_new_holder=lambda c, e: holders.append((c, e)))
    with sim.hold(callbacks=told) as held:
        assert held.lease.epoch == 2
        taken_at = sim.time.store_clock.now()
    # Not before the lease had expired, and not long after (the waiter wakes at expiry).
    assert first.expires_at <= taken_at <= first.expires_at + timedelta(seconds=0.01)
    assert holders == [("conn-a", 1), ("conn-b", 2)]
    mine = [(r.entry.event, r.entry.outcome, r.entry.reason, r.entry.epoch)
            for r in audit_of(sim.store, "conn-b")]
    # Reads wrote nothing (the wait begins with one): the takeover naming epoch 1, the
    # release.
    assert mine == [
        (LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER, None, 2),
        (LifecycleEvent.RELEASE, Outcome.RELEASED, None, 2)]
    assert len(sim.pauses) > 3  # it did wait, reading in between


def test_an_active_holder_is_never_preempted_by_default() -> None:
    sim = make_sim()
    sim.rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=300)
    with pytest.raises(LeaseNotAcquired) as refused, sim.hold(wait=60):
        pytest.fail("must not hold")
    error = refused.value
    assert (error.reason, error.connector_id, error.epoch) == (Reason.LEASE_HELD, "conn-a", 1)
    assert error.holder is not None and error.holder.state is LeaseState.ACTIVE
    assert "conn-a" in str(error) and "lease_held" in str(error)
    assert rows(sim.store) == [("conn-a", 1, False)]
    assert audit_of(sim.store, "conn-b") == []  # it only read: no write, no audit row
    assert sum(sim.pauses) == pytest.approx(60)  # the whole wait, and no more


def test_wait_zero_is_one_try() -> None:
    sim = make_sim()
    sim.rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=300)
    with pytest.raises(LeaseNotAcquired), sim.hold(wait=0):
        pass
    assert sim.pauses == []
    # On an expired lease, one try is the probe and the takeover it calls for.
    sim.time.advance(300)
    with sim.hold(wait=0) as held:
        assert held.lease.epoch == 2
    assert sim.pauses == []


def test_takeover_never_only_acquires() -> None:
    sim = make_sim()
    lease = sim.rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30).lease
    assert lease is not None
    sim.rival.release(lease)
    with pytest.raises(LeaseNotAcquired) as refused, sim.hold(wait=5, takeover="never"):
        pass
    assert refused.value.reason is Reason.TAKEOVER_REQUIRED
    assert rows(sim.store) == [("conn-a", 1, True)]


def test_preempt_takes_an_active_lease_when_the_policy_allows() -> None:
    sim = make_sim(rules(preempt=True))
    sim.rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=300)
    with sim.hold(wait=0, takeover=TakeoverPolicy.PREEMPT) as held:
        assert held.lease.epoch == 2


def test_preempt_refused_by_the_policy_falls_back_to_waiting() -> None:
    sim = make_sim(rules(preempt=False))
    sim.rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=20)
    with sim.hold(wait=None, takeover="preempt") as held:
        assert held.lease.epoch == 2
    denied = [(r.entry.event, r.entry.reason) for r in audit_of(sim.store, "conn-b")
              if r.entry.outcome is Outcome.DENIED]
    # A read, one refused preemption, then plain waiting until expiry.
    assert denied == [(LifecycleEvent.TAKEOVER, Reason.PREEMPTION_DENIED)]


def test_a_policy_refusal_is_final_at_once() -> None:
    sim = make_sim(rules(preempt=False, connector_id="conn-a"))
    sim.max_pauses = 0
    with pytest.raises(LeaseNotAcquired) as refused, sim.hold(wait=None):
        pass
    assert refused.value.reason is Reason.POLICY_DENIED
    assert rows(sim.store) == []


def test_backoff_grows_with_jitter_and_stays_within_the_wait() -> None:
    sim = make_sim()
    sim.rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=300)
    draws = iter([0.0, 1 - 1e-9] * 100)
    with pytest.raises(LeaseNotAcquired), sim.hold(
            wait=3.0, random=lambda: next(draws),
            timing=HoldTiming(min_backoff=0.1, max_backoff=0.8)):
        pass
    pauses = sim.pauses
    assert pauses[:4] == pytest.approx([0.05, 0.2, 0.2, 0.8])  # base 0.1, 0.2, 0.4, 0.8
    assert all(p <= 0.8 + 1e-9 for p in pauses)
    assert sum(pauses) == pytest.approx(3.0)


def test_store_outage_while_waiting_is_retried_then_reported() -> None:
    sim = make_sim()
    sim.faulty.mode = "down"
    with pytest.raises(LeaseNotAcquired) as refused, sim.hold(wait=2):
        pass
    assert refused.value.reason is Reason.STORE_UNAVAILABLE
    assert refused.value.error is not None and "connection refused" in refused.value.error
    assert len(sim.pauses) > 2

    # The store comes back during the wait: the lease is had.
    sim = make_sim()
    sim.faulty.mode = "down"

    def recover() -> None:
        if len(sim.pauses) == 3:
            sim.faulty.mode = None

    sim.after_pause = recover
    with sim.hold(wait=60) as held:
        assert held.lease.epoch == 1


def test_release_on_exception_and_a_failed_release_does_not_hide_it(
        caplog: pytest.LogCaptureFixture) -> None:
    sim = make_sim()
    with pytest.raises(ValueError, match="body failed"), sim.hold():
        raise ValueError("body failed")
    assert rows(sim.store) == [("conn-b", 1, True)]

    sim = make_sim()
    caplog.set_level(logging.ERROR, "mos_lease.holder")
    with pytest.raises(ValueError, match="body failed"), sim.hold():
        sim.faulty.mode = "down"
        raise ValueError("body failed")
    assert rows(sim.store) == [("conn-b", 1, False)]  # not released: it will expire
    assert any("release of" in r.getMessage() and "failed" in r.getMessage()
               for r in caplog.records)


def test_a_holder_holds_once_and_async_holders_need_async_with() -> None:
    sim = make_sim()
    holder = sim.hold()
    with holder:
        pass
    with pytest.raises(InvalidInput), holder:
        pass
    async_holder = hold(AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), policy=ALLOW),
                        IDENT, "conn-b", scopes=SCOPES, ttl=5, timing=HoldTiming(clock_step=0))
    with pytest.raises(TypeError, match="async with"), async_holder:
        pass


class RecordingNotices:
    """A notice source that only records who listens."""

    def __init__(self) -> None:
        self.listening: list[LeaseIdentity] = []

    def subscribe(self, identity: LeaseIdentity, callback: Callable[[int, str], object]
                  ) -> None:
        self.listening.append(identity)

    def unsubscribe(self, identity: LeaseIdentity, callback: Callable[[int, str], object]
                    ) -> None:
        self.listening.remove(identity)


def test_a_wait_that_fails_or_is_cancelled_stops_listening_for_notices() -> None:
    notices = RecordingNotices()
    refusing = ConnectorLeaseCoordinator(InMemoryLeaseStore(),
                                         policy=rules(False, connector_id="conn-z"))
    with pytest.raises(LeaseNotAcquired), hold(refusing, IDENT, "conn-b", scopes=SCOPES, ttl=5,
                                               notices=notices, timing=HoldTiming(clock_step=0)):
        pass
    assert notices.listening == []

    async def scenario() -> None:
        store = AsyncInMemoryLeaseStore()
        rival = AsyncConnectorLeaseCoordinator(store, ALLOW)
        assert (await rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30)).ok

        async def enter() -> None:
            async with hold(AsyncConnectorLeaseCoordinator(store, ALLOW), IDENT, "conn-b",
                            scopes=SCOPES, ttl=5, notices=notices, timing=HoldTiming(clock_step=0)):
                pass

        waiting_task = asyncio.ensure_future(enter())
        await asyncio.sleep(0.05)
        assert notices.listening == [IDENT] and not waiting_task.done()
        waiting_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting_task
        assert notices.listening == []

    asyncio.run(scenario())


def test_using_a_holder_outside_its_block_is_refused() -> None:
    holder = make_sim().hold()
    with pytest.raises(InvalidInput):
        _ = holder.lease
    with pytest.raises(InvalidInput):
        holder.issue_grant(scopes=SCOPES, ttl=5)


# --- bad input --------------------------------------------------------------------------------

BAD: list[tuple[str, dict[str, Any]]] = [
    ("identity", {"identity": "acme/agent-1/binding-1"}),
    ("identity", {"identity": None}),
    ("connector_id", {"connector_id": ""}),
    ("connector_id", {"connector_id": " conn"}),
    ("connector_id", {"connector_id": 7}),
    ("scopes", {"scopes": ["tool run"]}),
    ("scopes", {"scopes": 5}),
    ("ttl", {"ttl": -1}),
    ("ttl", {"ttl": 0}),
    ("ttl", {"ttl": 301}),
    ("ttl", {"ttl": 10**400}),
    ("ttl", {"ttl": float("inf")}),
    ("ttl", {"ttl": True}),
    ("ttl", {"ttl": "10"}),
    ("wait", {"wait": -0.5}),
    ("wait", {"wait": float("inf")}),
    ("wait", {"wait": float("nan")}),
    ("wait", {"wait": 10**12}),
    ("wait", {"wait": True}),
    ("wait", {"wait": "5"}),
    ("takeover", {"takeover": "sometimes"}),
    ("takeover", {"takeover": "EXPIRED"}),
    ("takeover", {"takeover": 1}),
    ("takeover", {"takeover": None}),
    ("on_lost", {"callbacks": HoldCallbacks(on_lost="print")}),  # type: ignore[arg-type]
    ("on_expiring", {"callbacks": HoldCallbacks(on_expiring=3)}),  # type: ignore[arg-type]
    ("on_event", {"callbacks": HoldCallbacks(on_event=[])}),  # type: ignore[arg-type]
    ("callbacks", {"callbacks": {"on_lost": print}}),
    # A healthy 10 s lease comes that close:
    ("expiring_within", {"timing": HoldTiming(expiring_within=5.0)}),
    ("expiring_within", {"timing": HoldTiming(expiring_within=-1)}),
    ("min_backoff", {"timing": HoldTiming(min_backoff=0)}),
    ("max_backoff", {"timing": HoldTiming(max_backoff=float("nan"))}),
    ("clock_step", {"timing": HoldTiming(clock_step=-1)}),
    ("timing", {"timing": 5}),
    ("cancel_on_loss", {"cancel_on_loss": True}),  # a thread cannot be cancelled
    ("cancel_on_loss", {"cancel_on_loss": "yes"}),
    ("heartbeat_coordinator", {"heartbeat_coordinator": object()}),
    ("heartbeat_coordinator",
     {"heartbeat_coordinator": AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(),
                                                              policy=ALLOW)}),
    ("clock", {"clock": 5}),
    ("coordinator", {"coordinator": "postgresql://"}),
]


@pytest.mark.parametrize(("field", "override"), BAD, ids=[f"{f}-{i}" for i, (f, _) in
                                                          enumerate(BAD)])
def test_bad_input_is_refused_before_anything_is_written(field: str,
                                                         override: dict[str, Any]) -> None:
    sim = make_sim()
    kw: dict[str, Any] = {"coordinator": sim.waiter, "identity": IDENT,
                          "connector_id": "conn-b", "scopes": SCOPES, "ttl": 10}
    kw.update(override)
    with pytest.raises(InvalidInput) as refused:
        hold(kw.pop("coordinator"), kw.pop("identity"), kw.pop("connector_id"), **kw)
    assert refused.value.field.startswith(field), refused.value
    assert sim.faulty.calls == 0
    assert audit_of(sim.store) == [] and rows(sim.store) == []


def test_backoff_bounds_the_keeper_refuses_are_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="min_backoff <= max_backoff"):
        make_sim().hold(timing=HoldTiming(min_backoff=2, max_backoff=1))


def test_a_ttl_above_the_coordinators_cap_writes_nothing() -> None:
    sim = make_sim()
    sim.waiter = ConnectorLeaseCoordinator(sim.faulty, ALLOW, lease_ttl_cap=5)
    with pytest.raises(InvalidInput, match="ttl"), sim.hold(ttl=10):
        pass
    assert audit_of(sim.store) == [] and rows(sim.store) == []


# --- holding: loss, on real time --------------------------------------------------------------

TTL = 0.6  # renewals every ~0.2 s, local deadline 0.54 s after the last renewal's start


@attrs.define
class Live:
    store: InMemoryLeaseStore
    faulty: Faulty
    coordinator: ConnectorLeaseCoordinator
    rival: ConnectorLeaseCoordinator
    events: list[tuple[str, object]] = attrs.Factory(list)

    def callbacks(self) -> dict[str, Any]:
        return {"callbacks": HoldCallbacks(**{
            name: (lambda *a, n=name: self.events.append((n, a[0] if a else None)))
            for name in ("on_started", "on_stopped", "on_lost", "on_expiring")})}

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


@pytest.fixture
def live() -> Iterator[Live]:
    store = InMemoryLeaseStore()
    faulty = Faulty(store)
    yield Live(store, faulty, ConnectorLeaseCoordinator(faulty, ALLOW),
               ConnectorLeaseCoordinator(store, ALLOW))
    faulty.mode = None


def test_loss_while_holding_is_reported_every_way(live: Live) -> None:
    with hold(live.coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL, **live.callbacks(),
              timing=HoldTiming(clock_step=0)) as held:
        epoch = held.lease.epoch
        started = time.monotonic()
        taken = live.rival.takeover(IDENT, "conn-a", scopes=SCOPES, ttl=30,
                                    expected_epoch=epoch)  # AllowAll lets it preempt
        assert taken.ok
        loss = held.wait_lost(2.0)
        assert time.monotonic() - started < TTL + 1.0  # within the keeper's bound
        assert loss is not None and (loss.cause, loss.reason) == (LossCause.DENIED,
                                                                  Reason.STALE_EPOCH)
        assert held.lost == loss
        audited = len(audit_of(live.store))
        with pytest.raises(LeaseLost) as raised:
            held.issue_grant(scopes=SCOPES, ttl=5)
        assert raised.value.loss == loss
        assert len(audit_of(live.store)) == audited  # refused locally
        with pytest.raises(LeaseLost):
            _ = held.lease
    assert live.names() == ["on_started", "on_lost", "on_stopped"]
    assert live.events[1][1] == loss
    # The rival's lease was not released by the loser's exit.
    assert rows(live.store) == [("conn-a", 2, False)]


def test_expiring_is_reported_once_before_loss_when_renewals_fail(live: Live) -> None:
    with hold(live.coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL, **live.callbacks(),
              timing=HoldTiming(clock_step=0, expiring_within=0.2)) as held:
        live.faulty.mode = "down"
        loss = held.wait_lost(2.0)
    assert loss is not None and loss.cause is LossCause.DEADLINE
    assert live.names() == ["on_started", "on_expiring", "on_lost", "on_stopped"]
    remaining = live.events[1][1]
    assert isinstance(remaining, float) and 0 < remaining <= 0.2


def test_expiring_is_reported_once_per_deadline_on_fake_time() -> None:
    sim = make_sim()
    reports: list[float] = []
    with sim.hold(ttl=10, timing=HoldTiming(expiring_within=2),
                  callbacks=HoldCallbacks(on_expiring=reports.append)) as held:
        # Deadline 9 s after the acquire began; nothing to say until 2 s before it.
        assert held._check_expiring() == pytest.approx(7.0)
        sim.time.advance(7.5)
        for _ in range(3):
            held._check_expiring()
        assert reports == [pytest.approx(1.5)]
        # A renewal that succeeds moves the deadline and re-arms the report (woken: the
        # engine's renewal is due on fake time, its pause is real).
        engine = held._engine
        assert engine is not None
        before = engine.deadline(IDENT)
        held._wake()
        until = time.monotonic() + 5
        while engine.deadline(IDENT) == before and time.monotonic() < until:
            time.sleep(0.01)
        assert held._check_expiring() == pytest.approx(7.0)
        sim.time.advance(8.0)
        held._check_expiring()
        held._check_expiring()
        assert reports == [pytest.approx(1.5), pytest.approx(1.0)]


def test_expiring_is_silent_while_renewals_succeed(live: Live) -> None:
    with hold(live.coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL, **live.callbacks(),
              timing=HoldTiming(clock_step=0, expiring_within=0.1)) as held:
        assert held.wait_lost(1.5) is None
    assert live.names() == ["on_started", "on_stopped"]
    assert rows(live.store) == [("conn-b", 1, True)]


def test_callbacks_that_raise_are_logged_and_holding_goes_on(
        live: Live, caplog: pytest.LogCaptureFixture) -> None:
    def explode(*_args: object) -> None:
        raise RuntimeError("callback bug")

    caplog.set_level(logging.ERROR, "mos_lease.holder")
    with hold(live.coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL,
              timing=HoldTiming(clock_step=0),
              callbacks=HoldCallbacks(on_started=explode, on_new_holder=explode,
                                      on_stopped=explode, on_lost=explode)) as held:
        time.sleep(0.3)  # past a renewal
        assert held.lost is None and held.issue_grant(scopes=SCOPES, ttl=1).ok
    assert rows(live.store) == [("conn-b", 1, True)]
    failed = {r.getMessage() for r in caplog.records}
    assert {"mos_lease: on_started callback failed", "mos_lease: on_new_holder callback "
            "failed", "mos_lease: on_stopped callback failed"} <= failed


def test_a_notice_wakes_a_waiter_and_ends_a_superseded_holder(live: Live) -> None:
    first = live.rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30).lease
    assert first is not None
    holder = hold(live.coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL, wait=10,
                  # pauses of at least 1.5 s
                  timing=HoldTiming(clock_step=0, min_backoff=3, max_backoff=3))
    outcome: list[object] = []

    def enter() -> None:
        with holder as held:
            outcome.append(held.lease.epoch)
            outcome.append(held.wait_lost(5))

    thread = threading.Thread(target=enter)
    thread.start()
    def has_read() -> bool:
        engine = holder._engine
        return engine is not None and engine.stats().campaign_reads > 0

    while not has_read():  # it read the rival's lease; it is pausing now
        time.sleep(0.01)
    time.sleep(0.05)
    live.rival.release(first)
    released = time.monotonic()
    holder._notice(LeaseIdentity("acme", "agent-1", "other"), 1)  # another identity: ignored
    holder._notice(IDENT, 1)
    while not outcome:
        time.sleep(0.01)
    assert time.monotonic() - released < 1.0  # woken, not at the end of a 1.5 s pause
    assert outcome == [2]
    holder._notice(IDENT, 2)  # its own epoch: nothing new
    time.sleep(0.05)
    assert holder.lost is None
    holder._notice(IDENT, 3)  # a forged notice: the read it triggers still finds epoch 2
    time.sleep(0.05)
    assert holder.lost is None
    read = holder.coordinator.current_holders

    def superseded(identities: Sequence[LeaseIdentity]) -> list[HolderView | None]:
        return [None if view is None else attrs.evolve(view, epoch=3)
                for view in read(identities)]

    holder.coordinator.current_holders = superseded  # type: ignore[method-assign]
    holder._notice(IDENT, 3)  # confirmed by the read: lost at once, before any heartbeat
    thread.join(2)
    loss = outcome[1]
    assert isinstance(loss, LeaseLoss) and loss.reason is Reason.STALE_EPOCH


def test_a_notice_whose_read_shows_the_held_epoch_released_ends_the_holding(live: Live) -> None:
    """The notice-confirmed loss is the supervisor's rule (schedule.superseded): a read
    after a notice that finds the held epoch released (an operator released it) is a loss,
    as a newer epoch is."""
    with hold(live.coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=30,
              timing=HoldTiming(clock_step=0)) as held:
        assert live.rival.release(held.lease).ok  # released behind the holder's back
        held._notice(IDENT, held.lease.epoch)  # its own epoch: not worth a read
        time.sleep(0.05)
        assert held.lost is None
        held._notice(IDENT, held.lease.epoch + 1)  # a read is made: it shows the release
        loss = held.wait_lost(2.0)
        assert loss is not None and (loss.cause, loss.reason) == (LossCause.DENIED,
                                                                  Reason.LEASE_RELEASED)


# --- asyncio ----------------------------------------------------------------------------------


def async_live() -> tuple[InMemoryLeaseStore, Faulty, AsyncConnectorLeaseCoordinator,
                          AsyncConnectorLeaseCoordinator]:
    store = InMemoryLeaseStore()
    faulty = Faulty(store)
    return (store, faulty, AsyncConnectorLeaseCoordinator(AsyncFaulty(faulty), ALLOW),
            AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(store), ALLOW))


def test_async_cancel_on_loss_raises_lease_lost_at_the_async_with() -> None:
    async def scenario() -> None:
        store, _, coordinator, rival = async_live()
        reached: list[str] = []
        started = time.monotonic()
        with pytest.raises(LeaseLost) as raised:
            async with hold(coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL,
                            cancel_on_loss=True, timing=HoldTiming(clock_step=0)) as held:
                await rival.takeover(IDENT, "conn-a", scopes=SCOPES, ttl=30,
                                     expected_epoch=held.lease.epoch)
                await asyncio.sleep(5)
                reached.append("after sleep")
        assert time.monotonic() - started < 1.0
        assert reached == []
        assert raised.value.loss.reason is Reason.STALE_EPOCH
        assert isinstance(raised.value.__cause__, asyncio.CancelledError)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0.01)  # no cancellation left pending for the task
        assert rows(store) == [("conn-a", 2, False)]

    asyncio.run(scenario())


def test_async_loss_in_a_block_that_never_awaits_leaves_no_stray_cancellation() -> None:
    async def scenario() -> None:
        _, _, coordinator, _ = async_live()
        with pytest.raises(LeaseLost):
            async with hold(coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL,
                            cancel_on_loss=True, timing=HoldTiming(clock_step=0)) as held:
                # A newer epoch confirmed by a read: loss, and the cancel, now.
                engine = held._engine
                assert engine is not None
                with engine._core.lock:
                    changes = engine._core.schedule.reveal(IDENT, held.lease, LeaseLoss(
                        LossCause.DENIED, Reason.STALE_EPOCH, time.monotonic()))
                engine._core.report(changes)
        await asyncio.sleep(0.01)  # would raise CancelledError if the cancel were left

    asyncio.run(scenario())


def test_async_cancellation_from_elsewhere_still_propagates() -> None:
    async def scenario() -> None:
        store, _, coordinator, _ = async_live()
        entered = asyncio.Event()

        async def body() -> None:
            async with hold(coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL,
                            cancel_on_loss=True, timing=HoldTiming(clock_step=0)):
                entered.set()
                await asyncio.sleep(5)

        task = asyncio.ensure_future(body())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rows(store) == [("conn-b", 1, True)]  # released on the way out

    asyncio.run(scenario())


def test_async_without_cancel_reports_loss_on_next_use() -> None:
    async def scenario() -> None:
        _, faulty, coordinator, _ = async_live()
        lost: list[LeaseLoss] = []
        async with hold(coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL,
                        timing=HoldTiming(clock_step=0),
                        callbacks=HoldCallbacks(on_lost=lost.append)) as held:
            faulty.mode = "down"
            loss = await asyncio.wait_for(held.wait_lost(), 2.0)
            assert loss.cause is LossCause.DEADLINE and lost == [loss]
            with pytest.raises(LeaseLost):
                await held.issue_grant(scopes=SCOPES, ttl=1)
            faulty.mode = None
        # Ended normally: no exception at exit without cancel_on_loss.

    asyncio.run(scenario())


def test_async_waiting_and_release() -> None:
    async def scenario() -> None:
        fake = FakeTime()
        store = InMemoryLeaseStore(fake.store_clock)
        coordinator = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(store), ALLOW)
        rival = ConnectorLeaseCoordinator(store, ALLOW)
        rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=20)
        holders: list[tuple[str, int]] = []
        async with hold(coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=10, clock=fake.clock,
                        sleep=fake.async_sleep, random=lambda: 0.5,
                        timing=HoldTiming(clock_step=0),
                        callbacks=HoldCallbacks(
                            on_new_holder=lambda c, e: holders.append((c, e)))) as held:
            assert held.lease.epoch == 2
            assert (await held.issue_grant(scopes=SCOPES, ttl=5)).ok
        assert holders == [("conn-a", 1), ("conn-b", 2)]
        assert rows(store) == [("conn-b", 2, True)]
        with pytest.raises(LeaseNotAcquired) as refused:
            async with hold(coordinator, IDENT, "conn-c", scopes=SCOPES, ttl=10, wait=0,
                            takeover="never", timing=HoldTiming(clock_step=0)):
                pass
        assert (refused.value.reason, refused.value.epoch) == (Reason.TAKEOVER_REQUIRED, 2)

    asyncio.run(scenario())


def test_an_asyncio_waiter_pauses_and_leaves_the_loop_to_others() -> None:
    """Waiting is pausing: while hold() waits for a lease held elsewhere, the other tasks of
    the loop run (a wait whose every pause ended at once would hold the loop until it gave
    up)."""
    async def scenario() -> None:
        _, _, coordinator, rival = async_live()
        await rival.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30)
        ticks = [0]

        async def other() -> None:
            while True:
                ticks[0] += 1
                await asyncio.sleep(0.01)

        beside = asyncio.ensure_future(other())
        with pytest.raises(LeaseNotAcquired):
            async with hold(coordinator, IDENT, "conn-b", scopes=SCOPES, ttl=TTL, wait=0.3,
                            timing=HoldTiming(clock_step=0, min_backoff=1, max_backoff=1)):
                pytest.fail("held a lease another connector holds")
        beside.cancel()
        assert ticks[0] >= 10

    asyncio.run(scenario())
