"""The ``on_event`` hook: one typed event per lifecycle attempt (matching the audit log), one
per store call, keeper renewals, retries and losses; a failing hook never breaks anything."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import attrs
import pytest

import mos_lease.observed as observed_module
from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    AsyncLeaseKeeper,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseKeeper,
    Outcome,
    Reason,
    StoreUnavailable,
    hold,
)
from mos_lease.events import (
    Event,
    Lost,
    OperationFinished,
    RenewalRetry,
    Renewed,
    StoreCall,
    store_system,
)
from mos_lease.holder import HoldCallbacks, HoldTiming
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.core.test_keeper import TTL, _async_rig, make_rig
from tests.helpers import IDENT, OTHER_IDENT, SCOPES, CountingIds, Env, FaultyStore, make_env


class Ticking:
    """A monotonic clock that moves 1 ms on every reading, so every duration is a known,
    non-zero multiple of 1 ms."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def _hooked(env: Env, events: list[Event], **options: Any) -> ConnectorLeaseCoordinator:
    return ConnectorLeaseCoordinator(env.store, AllowAllPolicy(), id_source=CountingIds(),
                                     on_event=events.append, **options)


def _ops(events: list[Event]) -> list[OperationFinished]:
    return [e for e in events if isinstance(e, OperationFinished)]


def _calls(events: list[Event]) -> list[StoreCall]:
    return [e for e in events if isinstance(e, StoreCall)]


def _as_audit(e: OperationFinished) -> tuple[object, ...]:
    return (e.operation, e.outcome, e.reason, e.tenant_id, e.logical_agent_id, e.binding_id,
            e.connector_id, e.epoch, e.correlation_id)


def test_each_lifecycle_attempt_is_one_event_matching_its_audit_row() -> None:
    env = make_env()
    events: list[Event] = []
    c = _hooked(env, events, monotonic_clock=Ticking())
    lease = c.acquire(IDENT, "a", scopes=SCOPES, ttl=10, correlation_id="r1").lease
    assert lease is not None
    c.acquire(IDENT, "b", scopes=SCOPES, ttl=10)
    c.heartbeat(lease, ttl=10)
    c.heartbeat(attrs.evolve(lease, epoch=5), ttl=10)
    grant = c.issue_grant(lease, scopes=["tool:run"], ttl=5).grant
    assert grant is not None
    c.issue_grant(lease, scopes=["x"], ttl=5)
    before_validations = len(_ops(events))
    assert c.validate(grant, identity=IDENT, scopes=["tool:run"], correlation_id="v").ok
    validated = _ops(events)[before_validations:]
    c.validate(grant, identity=OTHER_IDENT, scopes=[])
    c.takeover(IDENT, "b", scopes=SCOPES, ttl=10, expected_epoch=7)
    taken = c.takeover(IDENT, "b", scopes=SCOPES, ttl=10, expected_epoch=1).lease
    assert taken is not None
    c.release(taken)
    c.release(taken)
    assert c.current_holder(IDENT) is not None  # a read: store calls, no operation event

    audited = [_as_audit(OperationFinished.of(r.entry, 0.0)) for r in env.audit()]
    reported = [_as_audit(e) for e in _ops(events) if e.outcome is not Outcome.VALIDATED]
    assert reported == audited
    assert len(audited) == 11
    # The successful validation (no audit row) is reported with what it validated.
    assert [_as_audit(e) for e in validated] == [(
        LifecycleEvent.GRANT_VALIDATE, Outcome.VALIDATED, None, "acme", "agent-1",
        "binding-1", "a", 1, grant.correlation_id)]
    # Durations are on the coordinator's clock: every store call reads it twice (1 ms),
    # every operation spans at least its store calls.
    calls = _calls(events)
    assert {round(call.duration, 6) for call in calls} == {0.001}
    assert all(e.duration >= 0.002 for e in _ops(events))
    # The refused acquire is named from the row its write found: no read before its record.
    assert [call.operation for call in calls[:3]] == ["apply", "apply", "record"]
    assert {call.system for call in calls} == {"memory"} and all(
        call.error is None for call in calls)
    assert calls[-1].operation == "load"  # current_holder


def test_a_batched_heartbeat_reports_each_lease() -> None:
    env = make_env()
    first, second = env.acquire(), env.acquire(OTHER_IDENT)
    events: list[Event] = []
    c = _hooked(env, events)
    before = len(env.audit())
    results = c.heartbeat_many([first, attrs.evolve(first, epoch=3), second], ttl=20)
    assert [r.reason for r in results] == [None, Reason.EPOCH_MISMATCH, None]
    audited = sorted(_as_audit(OperationFinished.of(r.entry, 0.0))
                     for r in env.audit()[before:])
    assert sorted(_as_audit(e) for e in _ops(events)) == audited and len(audited) == 3
    (batch,) = [call for call in _calls(events) if call.operation == "renew_many"]
    assert batch.batch_size == 3


def test_a_lost_commit_reports_the_failed_call_and_the_attempt_that_stood() -> None:
    env = make_env()
    faulty = FaultyStore(env.store)
    events: list[Event] = []
    c = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=CountingIds(),
                                  on_event=events.append)
    faulty.lose_commit = "after"
    result = c.acquire(IDENT, "a", scopes=SCOPES, ttl=10)
    assert result.ok and result.reconciled
    assert [(call.operation, call.error) for call in _calls(events)] == [
        ("apply", "CommitOutcomeUnknown"), ("event_committed", None), ("load", None)]
    assert [(e.outcome, e.epoch) for e in _ops(events)] == [(Outcome.ACQUIRED, 1)]
    assert {call.system for call in _calls(events)} == {"other"}  # a wrapper of its own

    events.clear()
    faulty.lose_commit = "before"  # never committed: the rival's row is then found
    assert c.acquire(OTHER_IDENT, "a", scopes=SCOPES, ttl=10).ok
    assert [(e.outcome, e.reason) for e in _ops(events)] == [(Outcome.ACQUIRED, None)]
    assert len(_ops(events)) == len({e.correlation_id for e in _ops(events)})


def test_an_unknown_grant_and_a_failed_read_are_reported_as_they_happened() -> None:
    env = make_env()
    lease = env.acquire()
    grant = env.coordinator.issue_grant(lease, scopes=["tool:run"], ttl=5).grant
    assert grant is not None
    faulty = FaultyStore(env.store)
    events: list[Event] = []
    c = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=CountingIds(),
                                  on_event=events.append)
    # A grant minted by another coordinator is unknown here: refused without a read, and
    # nothing from the unrecognized object is trusted for the event either.
    assert c.validate(grant, identity=IDENT, scopes=["tool:run"],
                      correlation_id="probe").reason is Reason.GRANT_UNKNOWN
    assert [(call.operation, call.error) for call in _calls(events)] == [("record", None)]
    assert [_as_audit(e) for e in _ops(events)] == [(
        LifecycleEvent.GRANT_VALIDATE, Outcome.DENIED, Reason.GRANT_UNKNOWN, "acme",
        "agent-1", "binding-1", "unrecognized", None, "probe")]
    events.clear()
    # A heartbeat refused by its guard is named from the row its write found and audited;
    # when that record fails the exception reaches the caller, the failed call is
    # reported, and no lifecycle event is invented for an attempt that was not recorded.
    faulty.fail_record = True
    with pytest.raises(StoreUnavailable, match="connection refused"):
        c.heartbeat(attrs.evolve(lease, epoch=9), ttl=10)
    assert [(call.operation, call.error) for call in _calls(events)] == [
        ("apply", None), ("record", "StoreUnavailable")]
    assert _ops(events) == []


def test_validation_that_cannot_read_the_store_reports_the_denial() -> None:
    env = make_env()
    faulty = FaultyStore(env.store)
    events: list[Event] = []
    c = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=CountingIds(),
                                  on_event=events.append)
    lease = c.acquire(IDENT, "a", scopes=SCOPES, ttl=10).lease
    assert lease is not None
    grant = c.issue_grant(lease, scopes=["tool:run"], ttl=5).grant
    assert grant is not None
    events.clear()
    faulty.fail_load = True
    assert c.validate(grant, identity=IDENT, scopes=["tool:run"]).reason is \
        Reason.STORE_UNAVAILABLE
    assert [(call.operation, call.error) for call in _calls(events)] == [
        ("load", "StoreUnavailable"), ("record", None)]
    assert [(e.operation, e.outcome, e.reason) for e in _ops(events)] == [
        (LifecycleEvent.GRANT_VALIDATE, Outcome.DENIED, Reason.STORE_UNAVAILABLE)]


def test_store_system_names_the_store() -> None:
    assert store_system(InMemoryLeaseStore()) == "memory"
    assert store_system(AsyncInMemoryLeaseStore()) == "memory"
    assert store_system(FaultyStore(InMemoryLeaseStore())) == "other"

    class Declared(FaultyStore):
        db_system = "cockroachdb"

    assert store_system(Declared(InMemoryLeaseStore())) == "cockroachdb"


def test_a_failing_hook_is_logged_once_per_kind_and_never_breaks_an_operation(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(event: Event) -> None:
        raise RuntimeError(f"exporter down ({type(event).__name__})")

    plain, hooked = make_env(), make_env()
    c = ConnectorLeaseCoordinator(hooked.store, AllowAllPolicy(), id_source=hooked.ids,
                                  on_event=broken)
    caplog.set_level(logging.DEBUG, logger="mos_lease")
    outcomes = [[coordinator.acquire(IDENT, "a", scopes=SCOPES, ttl=10).reason
                 for _ in range(3)] for coordinator in (plain.coordinator, c)]
    assert outcomes == [[None, Reason.LEASE_HELD, Reason.LEASE_HELD]] * 2
    def shape(env: Env) -> list[tuple[object, ...]]:
        return [(r.seq, r.entry.event, r.entry.outcome, r.entry.reason, r.entry.epoch)
                for r in env.audit()]

    assert shape(hooked) == shape(plain) and len(shape(plain)) == 3
    failures = [r for r in caplog.records if r.name == "mos_lease.events"]
    assert sorted(r.getMessage().split(" on ")[1].split(";")[0] for r in failures) == [
        "OperationFinished", "StoreCall"]
    assert all(r.levelno == logging.ERROR and r.exc_info for r in failures)


def test_on_event_must_be_callable() -> None:
    with pytest.raises(ConfigurationError, match="on_event"):
        ConnectorLeaseCoordinator(InMemoryLeaseStore(), on_event="print")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="on_event"):
        AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), on_event=42)  # type: ignore[arg-type]
    rig = make_rig()
    with pytest.raises(ConfigurationError, match="on_event"):
        rig.keeper(on_event=[])
    with pytest.raises(InvalidInput, match="on_event"):
        hold(rig.coordinator, IDENT, "a", scopes=SCOPES, ttl=9, timing=HoldTiming(clock_step=0),
             callbacks=HoldCallbacks(on_event="x"))  # type: ignore[arg-type]


def test_without_a_hook_the_plain_driver_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_args: object) -> object:
        raise AssertionError("observed driver used without a hook")

    monkeypatch.setattr(observed_module.Observation, "__init__", forbidden)
    env = make_env()
    lease = env.acquire()
    assert env.coordinator.heartbeat(lease, ttl=10).ok
    events: list[Event] = []
    with pytest.raises(AssertionError, match="observed driver"):
        _hooked(env, events).heartbeat(lease, ttl=10)


def test_the_async_coordinator_reports_the_same_events() -> None:
    async def scenario() -> list[Event]:
        events: list[Event] = []
        c = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy(),
                                           on_event=events.append)
        lease = (await c.acquire(IDENT, "a", scopes=SCOPES, ttl=10)).lease
        assert lease is not None
        assert (await c.acquire(IDENT, "b", scopes=SCOPES, ttl=10)).reason is Reason.LEASE_HELD
        grant = (await c.issue_grant(lease, scopes=["tool:run"], ttl=5)).grant
        assert grant is not None
        assert (await c.validate(grant, identity=IDENT, scopes=["tool:run"])).ok
        return events

    events = asyncio.run(scenario())
    assert [(e.operation, e.outcome, e.reason) for e in _ops(events)] == [
        (LifecycleEvent.ACQUIRE, Outcome.ACQUIRED, None),
        (LifecycleEvent.ACQUIRE, Outcome.DENIED, Reason.LEASE_HELD),
        (LifecycleEvent.GRANT_ISSUE, Outcome.GRANT_ISSUED, None),
        (LifecycleEvent.GRANT_VALIDATE, Outcome.VALIDATED, None)]
    assert [c.operation for c in _calls(events)] == [
        "apply", "apply", "record", "load", "record", "load"]
    assert {c.system for c in _calls(events)} == {"memory"}


# --- keepers --------------------------------------------------------------------------------


def test_keeper_reports_renewals_retries_with_their_cause_and_the_loss(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mos_lease")
    rig = make_rig()
    events: list[Event] = []
    keeper = rig.keeper(on_event=events.append)
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    keeper.step()  # wait
    keeper.step()  # renew
    assert events == [Renewed("acme", "agent-1", "binding-1", "conn-a", 1, 0.0)]
    rig.faulty.mode = "down"
    while not keeper.lost.is_set():
        keeper.step()
    retries = [e for e in events if isinstance(e, RenewalRetry)]
    assert len(retries) >= 5
    assert [r.attempt for r in retries] == list(range(1, len(retries) + 1))
    assert {r.cause for r in retries} == {"StoreUnavailable"}
    assert all(r.delay > 0 for r in retries)
    assert events[-1] == Lost("acme", "agent-1", "binding-1", "conn-a", 1, "deadline",
                              Reason.LEASE_EXPIRED)
    # Logged by the engine the keeper runs on (mos_lease.supervisor), as for every binding.
    warned = [r for r in caplog.records
              if r.name == "mos_lease.supervisor" and r.levelno == logging.WARNING]
    retry_lines = [r.getMessage() for r in warned if "retrying in" in r.getMessage()]
    assert len(retry_lines) == len(retries)
    assert all("StoreUnavailable: connection refused" in line for line in retry_lines)
    assert any("lost: deadline" in r.getMessage() for r in warned)
    assert any(r.levelno == logging.DEBUG and "renewed" in r.getMessage()
               for r in caplog.records if r.name == "mos_lease.supervisor")


def test_a_stop_is_reported_as_a_stopped_loss() -> None:
    rig = make_rig()
    events: list[Event] = []
    keeper = rig.keeper(on_event=events.append)
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    assert keeper.stop() is not None
    assert events == [Lost("acme", "agent-1", "binding-1", "conn-a", 1, "stopped",
                           Reason.LEASE_RELEASED)]


def test_async_keeper_reports_the_same_events() -> None:
    async def scenario() -> list[Event]:
        time_, faulty, coordinator, _ = _async_rig()
        events: list[Event] = []
        keeper = AsyncLeaseKeeper(coordinator, clock_step=0, ttl=TTL, clock=time_.clock,
                                  sleep=time_.async_sleep, random=lambda: 0.5,
                                  background=False, on_event=events.append)
        assert (await keeper.acquire(IDENT, "conn-a", scopes=SCOPES)).ok
        await keeper.step()
        await keeper.step()
        faulty.mode = "down"
        while not keeper.lost.is_set():
            await keeper.step()
        return events

    events = asyncio.run(scenario())
    assert events[0] == Renewed("acme", "agent-1", "binding-1", "conn-a", 1, 0.0)
    retries = [e for e in events if isinstance(e, RenewalRetry)]
    assert retries and {r.cause for r in retries} == {"StoreUnavailable"}
    assert isinstance(events[-1], Lost) and events[-1].cause == "deadline"


def test_hold_passes_on_event_to_its_keeper() -> None:
    rig = make_rig()
    events: list[Event] = []
    with hold(rig.coordinator, IDENT, "conn-a", scopes=SCOPES, ttl=TTL, wait=0,
              clock=rig.time.clock, timing=HoldTiming(clock_step=0),
              callbacks=HoldCallbacks(on_event=events.append)) as held:
        assert held.lease is not None
        assert events == []
    assert events == [Lost("acme", "agent-1", "binding-1", "conn-a", 1, "stopped",
                           Reason.LEASE_RELEASED)]


def test_keeper_threads_are_named_without_lease_ids_or_scopes() -> None:
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    keeper = LeaseKeeper(coordinator, clock_step=0, ttl=30)
    result = keeper.acquire(IDENT, "conn-a", scopes=["tool:secret-scope"])
    try:
        assert result.lease is not None
        name = keeper._thread.name if keeper._thread is not None else ""
        assert name == "mos-lease-keeper acme/agent-1/binding-1"
        assert str(result.lease.lease_id) not in name and "secret" not in name
    finally:
        keeper.stop()
