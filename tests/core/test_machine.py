"""The pure lease state machine: no clock, guards that agree with refusals, epochs that never
wrap, and the reference write semantics every store must match."""

from __future__ import annotations

import ast
import inspect
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock
from uuid import UUID

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from mos_lease import LeaseIdentity, Outcome, Reason
from mos_lease import machine as m
from mos_lease.identity import MAX_EPOCH
from mos_lease.machine import (
    ALLOW,
    Acquire,
    Close,
    Command,
    Heartbeat,
    Insert,
    IssueGrant,
    PolicyVerdict,
    Release,
    Renew,
    Rotate,
    Takeover,
    apply_write,
    decide,
    grant_expiry,
    grant_refusal,
    guard_holds,
    identity_refusal,
    plan,
    presented_epoch,
    refusal,
    success_epoch,
    write_outcome,
)
from mos_lease.records import LeaseRow
from mos_lease.vocabulary import LeaseState

BASE = datetime(2030, 1, 1, tzinfo=UTC)
IDENT = LeaseIdentity("acme", "agent-1", "binding-1")
LEASE_IDS = [UUID(int=1), UUID(int=2)]
NEW_ID = UUID(int=3)
EVENT_ID = UUID(int=4)
CONNECTORS = ["c1", "c2"]

times = st.integers(-50, 50).map(lambda s: BASE + timedelta(seconds=s))
ttls = st.integers(1, 300).map(lambda s: timedelta(seconds=s))
epochs = st.one_of(st.integers(1, 4), st.sampled_from([MAX_EPOCH - 1, MAX_EPOCH]))
scope_sets = st.lists(st.sampled_from(["a", "b", "c"]), unique=True).map(
    lambda xs: tuple(sorted(xs)))


@st.composite
def rows(draw: st.DrawFn) -> LeaseRow | None:
    if draw(st.integers(0, 5)) == 0:
        return None
    acquired = draw(times)
    expires = acquired + draw(st.integers(0, 100).map(lambda s: timedelta(seconds=s)))
    return LeaseRow(
        identity=IDENT, lease_id=draw(st.sampled_from(LEASE_IDS)),
        connector_id=draw(st.sampled_from(CONNECTORS)), scopes=draw(scope_sets),
        epoch=draw(epochs), acquired_at=acquired, heartbeat_at=acquired, expires_at=expires,
        released_at=draw(st.none() | st.just(acquired)), updated_at=acquired,
    )


def _epoch_near(draw: st.DrawFn, row: LeaseRow | None) -> int:
    """Mostly the row's own epoch (so guards often hold), sometimes a neighbour."""
    if row is None:
        return draw(epochs)
    return draw(st.sampled_from([row.epoch, row.epoch, max(row.epoch - 1, 1),
                                 min(row.epoch + 1, MAX_EPOCH)]))


def _holder(draw: st.DrawFn, row: LeaseRow | None) -> tuple[str, UUID]:
    if row is not None and draw(st.booleans()):
        return row.connector_id, row.lease_id
    return draw(st.sampled_from(CONNECTORS)), draw(st.sampled_from(LEASE_IDS))


@st.composite
def commands(draw: st.DrawFn, row: LeaseRow | None) -> Command:
    kind = draw(st.sampled_from(["acquire", "takeover", "heartbeat", "release", "grant"]))
    connector, lease_id = _holder(draw, row)
    scopes, ttl, epoch = draw(scope_sets), draw(ttls), _epoch_near(draw, row)
    if kind == "acquire":
        return Acquire(IDENT, connector, scopes, ttl, NEW_ID, EVENT_ID, "corr")
    if kind == "takeover":
        return Takeover(IDENT, connector, scopes, ttl, epoch, draw(st.booleans()), NEW_ID,
                        EVENT_ID, "corr")
    if kind == "heartbeat":
        return Heartbeat(IDENT, connector, lease_id, epoch, ttl, EVENT_ID, "corr")
    if kind == "release":
        return Release(IDENT, connector, lease_id, epoch, EVENT_ID, "corr")
    if row is not None and draw(st.booleans()):
        scopes = row.scopes
    return IssueGrant(IDENT, connector, lease_id, epoch, scopes, ttl, EVENT_ID, "corr")


@st.composite
def situations(draw: st.DrawFn) -> tuple[LeaseRow | None, datetime, Command]:
    row = draw(rows())
    return row, draw(times), draw(commands(row))


# --- no clock, no randomness, no I/O -----------------------------------------------------------


class _NoClock:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the pure core touched datetime.{name}")


def _forbidden(*_args: object, **_kwargs: object) -> Any:
    raise AssertionError("the pure core read a clock or made an id")


@settings(max_examples=300, deadline=None)
@given(situations(), st.sampled_from([ALLOW, PolicyVerdict(False, Reason.POLICY_DENIED)]))
def test_decide_never_reads_a_clock(situation: tuple[LeaseRow | None, datetime, Command],
                                    verdict: PolicyVerdict) -> None:
    row, now, command = situation
    with mock.patch.object(m, "datetime", _NoClock()), \
            mock.patch.object(time, "time", _forbidden), \
            mock.patch.object(time, "time_ns", _forbidden), \
            mock.patch.object(time, "monotonic", _forbidden), \
            mock.patch.object(uuid, "uuid4", _forbidden), \
            mock.patch.object(uuid, "uuid1", _forbidden):
        first = decide(row, now, command, verdict)
        second = decide(row, now, command, verdict)
    assert first == second
    # And a different wall-clock moment changes nothing: only ``now`` is time.
    assert decide(row, now, command, verdict) == first


def test_the_machine_module_imports_nothing_that_tells_time() -> None:
    tree = ast.parse(inspect.getsource(m))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported <= {"__future__", "datetime", "uuid", "attrs", "mos_lease.identity",
                        "mos_lease.metadata", "mos_lease.records", "mos_lease.vocabulary"}
    called = {node.func.attr for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert not called & {"now", "utcnow", "today", "uuid4", "uuid1", "time", "monotonic",
                         "urandom", "random", "token_bytes"}


# --- guards and refusals agree -------------------------------------------------------------


@settings(max_examples=600, deadline=None)
@given(situations())
def test_guard_holds_iff_refusal_is_none_under_allow(
        situation: tuple[LeaseRow | None, datetime, Command]) -> None:
    row, now, command = situation
    decision = decide(row, now, command, ALLOW)
    reason = refusal(command, row, now)
    event(f"{type(command).__name__}: {reason or 'allowed'}")
    assert decision.reason == reason
    write = plan(command)
    if write is None:
        assert isinstance(command, IssueGrant)
        assert decision.write is None
    else:
        assert (decision.write is not None) == guard_holds(write, row, now)
        assert guard_holds(write, row, now) == (reason is None)
        if decision.write is not None:
            assert decision.write == write
    assert decision.allowed == (reason is None)
    entry = decision.audit
    assert entry.event_id == command.event_id and entry.identity == IDENT
    assert entry.connector_id == command.connector_id and entry.correlation_id == "corr"
    if reason is None:
        assert entry.outcome is not Outcome.DENIED and entry.reason is None
        assert entry.epoch == success_epoch(command)
    else:
        assert (entry.outcome, entry.reason) == (Outcome.DENIED, reason)
        assert entry.epoch == presented_epoch(command)


@settings(max_examples=300, deadline=None)
@given(situations(), st.sampled_from([Reason.POLICY_DENIED, Reason.SCOPE_NOT_AUTHORIZED,
                                      Reason.TTL_NOT_AUTHORIZED, Reason.PREEMPTION_DENIED]))
def test_a_policy_denial_wins_and_writes_nothing(
        situation: tuple[LeaseRow | None, datetime, Command], reason: Reason) -> None:
    row, now, command = situation
    decision = decide(row, now, command, PolicyVerdict(False, reason))
    assert (decision.outcome, decision.reason, decision.write) == (Outcome.DENIED, reason, None)
    assert decision.audit.reason is reason
    assert decision.audit.epoch == presented_epoch(command)


@settings(max_examples=400, deadline=None)
@given(situations())
def test_write_outcome_is_apply_where_the_guard_holds(
        situation: tuple[LeaseRow | None, datetime, Command]) -> None:
    row, now, command = situation
    write = plan(command)
    if write is None:
        return
    result = write_outcome(write, row, now)
    if not guard_holds(write, row, now):
        assert result is None
        return
    assert result == apply_write(write, row, now)
    assert result is not None
    assert result.identity == IDENT
    assert 1 <= result.epoch <= MAX_EPOCH
    assert result.state(now) is (LeaseState.RELEASED if isinstance(write, Close)
                                 else LeaseState.ACTIVE)
    if isinstance(write, Insert):
        assert row is None and result.epoch == 1
        assert (result.lease_id, result.expires_at) == (write.lease_id, now + write.ttl)
        return
    assert row is not None
    if isinstance(write, Rotate):
        assert result.epoch == row.epoch + 1
        assert result.lease_id == write.new_lease_id != row.lease_id
        assert (result.connector_id, result.scopes) == (write.connector_id, write.scopes)
        assert result.acquired_at == now and result.released_at is None
    else:
        assert (result.epoch, result.lease_id, result.connector_id, result.scopes) == (
            row.epoch, row.lease_id, row.connector_id, row.scopes)
        assert result.acquired_at == row.acquired_at
        if isinstance(write, Renew):
            assert result.expires_at == now + write.ttl and result.heartbeat_at == now
        else:
            assert result.released_at == now and result.expires_at == row.expires_at
    assert result.updated_at == now


# --- epochs at the maximum ---------------------------------------------------------------------


def _row(epoch: int = 1, *, expires: int = 10, released: bool = False) -> LeaseRow:
    return LeaseRow(IDENT, LEASE_IDS[0], "c1", ("a",), epoch, BASE, BASE,
                    BASE + timedelta(seconds=expires), BASE if released else None, BASE)


@pytest.mark.parametrize("preempt", [True, False])
@pytest.mark.parametrize("expires", [10, 0])  # active / expired at BASE
@pytest.mark.parametrize("released", [False, True])
def test_epochs_never_wrap_at_the_maximum(preempt: bool, expires: int, released: bool) -> None:
    row = _row(MAX_EPOCH, expires=expires, released=released)
    command = Takeover(IDENT, "c2", (), timedelta(seconds=5), MAX_EPOCH, preempt, NEW_ID,
                       EVENT_ID, "corr")
    write = plan(command)
    assert write is not None
    assert not guard_holds(write, row, BASE)
    assert write_outcome(write, row, BASE) is None
    assert refusal(command, row, BASE) is Reason.EPOCH_EXHAUSTED
    decision = decide(row, BASE, command, ALLOW)
    assert (decision.reason, decision.write) == (Reason.EPOCH_EXHAUSTED, None)
    assert decision.audit.epoch == MAX_EPOCH


def test_the_last_epoch_is_reachable_once() -> None:
    row = _row(MAX_EPOCH - 1, expires=0)
    command = Takeover(IDENT, "c2", (), timedelta(seconds=5), MAX_EPOCH - 1, False, NEW_ID,
                       EVENT_ID, "corr")
    decision = decide(row, BASE, command, ALLOW)
    assert decision.write is not None
    after = write_outcome(decision.write, row, BASE)
    assert after is not None and after.epoch == MAX_EPOCH
    assert decision.audit.epoch == MAX_EPOCH
    again = attrs.evolve(command, expected_epoch=MAX_EPOCH, new_lease_id=UUID(int=9))
    assert refusal(again, attrs.evolve(after, expires_at=BASE), BASE) is Reason.EPOCH_EXHAUSTED


# --- named refusals --------------------------------------------------------------------------


def _hb(epoch: int = 1, lease_id: UUID = LEASE_IDS[0], connector: str = "c1") -> Heartbeat:
    return Heartbeat(IDENT, connector, lease_id, epoch, timedelta(seconds=5), EVENT_ID, "corr")


@pytest.mark.parametrize(("row", "command", "reason"), [
    (None, Acquire(IDENT, "c1", (), timedelta(seconds=5), NEW_ID, EVENT_ID, "x"), None),
    (_row(), Acquire(IDENT, "c2", (), timedelta(seconds=5), NEW_ID, EVENT_ID, "x"),
     Reason.LEASE_HELD),
    (_row(expires=0), Acquire(IDENT, "c1", (), timedelta(seconds=5), NEW_ID, EVENT_ID, "x"),
     Reason.TAKEOVER_REQUIRED),
    (_row(released=True), Acquire(IDENT, "c1", (), timedelta(seconds=5), NEW_ID, EVENT_ID,
                                  "x"), Reason.TAKEOVER_REQUIRED),
    (None, _hb(), Reason.LEASE_MISSING),
    (_row(2), _hb(1), Reason.STALE_EPOCH),
    (_row(2), _hb(3), Reason.EPOCH_MISMATCH),
    (_row(), _hb(lease_id=LEASE_IDS[1]), Reason.LEASE_REPLACED),
    (_row(), _hb(connector="c2"), Reason.LEASE_REPLACED),
    (_row(released=True), _hb(), Reason.LEASE_RELEASED),
    (_row(expires=0), _hb(), Reason.LEASE_EXPIRED),
    (_row(), _hb(), None),
    (_row(), Takeover(IDENT, "c2", (), timedelta(seconds=5), 1, False, NEW_ID, EVENT_ID, "x"),
     Reason.PREEMPTION_DENIED),
    (_row(), Takeover(IDENT, "c2", (), timedelta(seconds=5), 1, True, NEW_ID, EVENT_ID, "x"),
     None),
    (_row(), Takeover(IDENT, "c2", (), timedelta(seconds=5), 2, True, NEW_ID, EVENT_ID, "x"),
     Reason.EPOCH_MISMATCH),
    (None, Takeover(IDENT, "c2", (), timedelta(seconds=5), 1, True, NEW_ID, EVENT_ID, "x"),
     Reason.LEASE_MISSING),
    (_row(), IssueGrant(IDENT, "c1", LEASE_IDS[0], 1, ("a", "b"), timedelta(seconds=5),
                        EVENT_ID, "x"), Reason.SCOPE_NOT_AUTHORIZED),
    (_row(), IssueGrant(IDENT, "c1", LEASE_IDS[0], 1, ("a",), timedelta(seconds=5),
                        EVENT_ID, "x"), None),
], ids=lambda v: type(v).__name__ if not isinstance(v, Reason | None) else str(v))
def test_refusals_are_named(row: LeaseRow | None, command: Command,
                            reason: Reason | None) -> None:
    assert refusal(command, row, BASE) is reason
    assert decide(row, BASE, command, ALLOW).reason is reason


def test_expiry_is_inclusive_and_release_wins() -> None:
    row = _row(expires=10)
    assert row.state(BASE + timedelta(seconds=10) - timedelta(microseconds=1)) is (
        LeaseState.ACTIVE)
    assert row.state(BASE + timedelta(seconds=10)) is LeaseState.EXPIRED
    assert _row(released=True).state(BASE - timedelta(days=1)) is LeaseState.RELEASED


def test_success_and_presented_epochs() -> None:
    acquire = Acquire(IDENT, "c1", (), timedelta(seconds=5), NEW_ID, EVENT_ID, "x")
    takeover = Takeover(IDENT, "c1", (), timedelta(seconds=5), 7, True, NEW_ID, EVENT_ID, "x")
    release = Release(IDENT, "c1", LEASE_IDS[0], 4, EVENT_ID, "x")
    assert (success_epoch(acquire), presented_epoch(acquire)) == (1, None)
    assert (success_epoch(takeover), presented_epoch(takeover)) == (8, 7)
    assert (success_epoch(release), presented_epoch(release)) == (4, 4)
    assert (success_epoch(_hb(5)), presented_epoch(_hb(5))) == (5, 5)


def test_grant_refusals() -> None:
    row = _row(expires=60)
    later = BASE + timedelta(seconds=30)

    def check(now: datetime = BASE, epoch: int = 1, requested: tuple[str, ...] = ("a",),
              granted: tuple[str, ...] = ("a",), row: LeaseRow | None = row) -> Reason | None:
        return grant_refusal(row, now, connector_id="c1", lease_id=LEASE_IDS[0], epoch=epoch,
                             granted_scopes=granted, grant_expires_at=later,
                             requested=requested)

    assert check() is None
    assert check(requested=()) is None
    assert check(now=later) is Reason.GRANT_EXPIRED
    assert check(row=None) is Reason.LEASE_MISSING
    assert check(epoch=2) is Reason.EPOCH_MISMATCH
    assert check(requested=("b",)) is Reason.SCOPE_NOT_AUTHORIZED  # beyond grant and lease
    assert check(requested=("b",), granted=("a", "b")) is Reason.SCOPE_NOT_AUTHORIZED
    assert check(row=attrs.evolve(row, epoch=2)) is Reason.STALE_EPOCH
    assert check(row=attrs.evolve(row, released_at=BASE)) is Reason.LEASE_RELEASED


def test_identity_refusal_order() -> None:
    assert identity_refusal(IDENT, IDENT) is None
    assert identity_refusal(IDENT, LeaseIdentity("x", "y", "z")) is Reason.TENANT_MISMATCH
    assert identity_refusal(IDENT, LeaseIdentity("acme", "y", "z")) is Reason.AGENT_MISMATCH
    assert identity_refusal(IDENT, LeaseIdentity("acme", "agent-1", "z")) is (
        Reason.BINDING_MISMATCH)


@settings(max_examples=200, deadline=None)
@given(rows(), times, ttls)
def test_grant_expiry_is_never_after_the_lease(row: LeaseRow | None, now: datetime,
                                               ttl: timedelta) -> None:
    if row is None:
        return
    expiry = grant_expiry(row, now, ttl)
    assert expiry <= row.expires_at and expiry <= now + ttl
    assert expiry in (row.expires_at, now + ttl)
