"""specs/transitions.md and the code agree, row by row and exhaustively."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import attrs
import pytest

from mos_lease.identity import MAX_EPOCH, LeaseIdentity
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
    decide,
    plan,
)
from mos_lease.reconciliation import is_own_write, reconciled_row
from mos_lease.records import LeaseRow, Snapshot
from mos_lease.validation import (
    Validate,
    read_refusal,
    slow_reply,
    validation_refusal,
    validation_refusal_unread,
)
from mos_lease.vocabulary import LeaseState, Outcome, Reason

SPEC = Path(__file__).resolve().parents[2] / "specs" / "transitions.md"
NOW = datetime(2030, 1, 1, tzinfo=UTC)
IDENTITY = LeaseIdentity("tenant", "agent", "binding")
LEASE_ID = UUID(int=7)
STATES = ("absent", "active", "expired", "released")
HOLDER_CONDITIONS = ("epoch_lower", "epoch_higher", "other_lease_id", "other_connector",
                     "match")
WRITES = {"insert": Insert, "rotate": Rotate, "renew": Renew, "close": Close}


def _table(heading: str) -> list[list[str]]:
    text = SPEC.read_text().split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]
    return [r for r in rows[2:] if r]  # drop the header and the ---|--- line


LIFECYCLE = _table("Lifecycle")


def _conditions(command: str, state: str) -> tuple[str, ...]:
    if state == "absent" or command == "acquire":
        return ("-",)
    if command == "takeover":
        # A row stamped later than now cannot be expired: its expiry lies after its stamp.
        behind = ("clock_behind",) if state != "expired" else ()
        return ("expected_ne", "at_max") + (
            ("preempt", "no_preempt") if state == "active" else ("expected_eq",)) + behind
    extra = ("scope_outside_lease",) if command == "issue_grant" and state == "active" else ()
    if command in ("heartbeat", "release") and state == "active":
        extra = ("clock_behind",)
    return HOLDER_CONDITIONS + extra


def _row(state: str, condition: str) -> LeaseRow | None:
    if state == "absent":
        return None
    epoch = MAX_EPOCH if condition == "at_max" else 5
    return LeaseRow(
        identity=IDENTITY, lease_id=LEASE_ID, connector_id="c1", scopes=("a", "b"),
        epoch=epoch, acquired_at=NOW - timedelta(minutes=1), heartbeat_at=NOW,
        expires_at=NOW - timedelta(seconds=1) if state == "expired" else NOW + timedelta(30),
        released_at=NOW - timedelta(seconds=5) if state == "released" else None,
        updated_at=NOW + timedelta(seconds=1) if condition == "clock_behind" else NOW)


def _command(name: str, condition: str) -> Command:
    ttl, event, correlation = timedelta(seconds=20), uuid4(), "spec"
    epoch = 5 if condition != "at_max" else MAX_EPOCH
    if name == "acquire":
        return Acquire(IDENTITY, "c2", ("a",), ttl, uuid4(), event, correlation)
    if name == "takeover":
        expected = epoch + 1 if condition == "expected_ne" else epoch
        return Takeover(IDENTITY, "c2", ("a",), ttl, expected,
                        condition in ("preempt", "clock_behind"), uuid4(), event, correlation)
    connector = "c9" if condition == "other_connector" else "c1"
    lease_id = uuid4() if condition == "other_lease_id" else LEASE_ID
    epoch += {"epoch_lower": -1, "epoch_higher": 1}.get(condition, 0)
    if name == "heartbeat":
        return Heartbeat(IDENTITY, connector, lease_id, epoch, ttl, event, correlation)
    if name == "release":
        return Release(IDENTITY, connector, lease_id, epoch, event, correlation)
    scopes = ("z",) if condition == "scope_outside_lease" else ("a",)
    return IssueGrant(IDENTITY, connector, lease_id, epoch, scopes, ttl, event, correlation)


def _matching(command: str, state: str, condition: str) -> list[list[str]]:
    return [r for r in LIFECYCLE
            if r[0] == command and r[1] in (state, "any" if state != "absent" else "")
            and r[2] == condition]


CASES = [(c, s, k) for c in ("acquire", "takeover", "heartbeat", "release", "issue_grant")
         for s in STATES for k in _conditions(c, s)]


@pytest.mark.parametrize(("command_name", "state", "condition"), CASES)
def test_every_case_has_exactly_one_row_and_the_code_agrees(
        command_name: str, state: str, condition: str) -> None:
    rows = _matching(command_name, state, condition)
    assert len(rows) == 1, f"{command_name}/{state}/{condition}: rows {rows}"
    _, _, _, outcome, reason, write, audit_epoch = rows[0]
    command = _command(command_name, condition)
    decision = decide(_row(state, condition), NOW, command, ALLOW)
    assert decision.outcome == Outcome(outcome)
    assert decision.reason == (None if reason == "-" else Reason(reason))
    assert type(decision.write) is WRITES.get(write, type(None))
    assert decision.audit.outcome == decision.outcome
    assert decision.audit.reason == decision.reason
    presented = getattr(command, "epoch", getattr(command, "expected_epoch", None))
    assert decision.audit.epoch == {
        "1": 1, "none": None, "expected": presented, "presented": presented,
        "expected+1": (presented or 0) + 1}[audit_epoch]


def test_every_table_row_is_reachable() -> None:
    reachable = {tuple(r) for case in CASES for r in _matching(*case)}
    assert reachable == {tuple(r) for r in LIFECYCLE}


@pytest.mark.parametrize("reason", [Reason.POLICY_DENIED, Reason.SCOPE_NOT_AUTHORIZED,
                                    Reason.TTL_NOT_AUTHORIZED, Reason.PREEMPTION_DENIED])
@pytest.mark.parametrize(("command_name", "state", "condition"), CASES)
def test_policy_refusal_wins_in_every_state(command_name: str, state: str, condition: str,
                                            reason: Reason) -> None:
    decision = decide(_row(state, condition), NOW, _command(command_name, condition),
                      PolicyVerdict(False, reason))
    assert (decision.outcome, decision.reason, decision.write) == (Outcome.DENIED, reason, None)


def test_validation_table_matches_the_pure_checks() -> None:
    rows = [r for r in _table("Validation") if r[2] != "validated"]
    table = {(r[0], r[1]): Reason(r[2]) for r in rows}
    other = {"tenant_mismatch": attrs.evolve(IDENTITY, tenant_id="x"),
             "agent_mismatch": attrs.evolve(IDENTITY, logical_agent_id="x"),
             "binding_mismatch": attrs.evolve(IDENTITY, binding_id="x")}

    def command(condition: str = "match", *, target: LeaseIdentity = IDENTITY,
                registry: Reason | None = None, expires: datetime = NOW + timedelta(10),
                requested: tuple[str, ...] = ("a",)) -> Validate:
        held = _command("heartbeat", condition)
        assert isinstance(held, Heartbeat)
        return Validate(target, requested, IDENTITY, held.connector_id, held.lease_id,
                        held.epoch, ("a", "b"), expires, registry, "spec")

    identity_rows = [reason for (check, _), reason in table.items() if check == "identity"]
    assert [validation_refusal_unread(command(target=other[r.value]))
            for r in identity_rows] == identity_rows
    # The identity is checked before what the registry says, and both before the row is read.
    dropped = table[("registry", "minted here but already dropped (only expired grants are "
                                 "dropped)")]
    assert validation_refusal_unread(command(registry=dropped)) is dropped
    assert validation_refusal_unread(
        command(target=other["tenant_mismatch"], registry=dropped)) is Reason.TENANT_MISMATCH

    def refusal(state: str, condition: str = "match", *, in_flight: float = 0.0,
                **fields: Any) -> Reason | None:
        return validation_refusal(command(condition, **fields), _row(state, condition), NOW,
                                  in_flight)

    lease_rows = {cond: reason for (check, cond), reason in table.items() if check == "lease"}
    for condition, reason in lease_rows.items():
        if condition == "no row":
            assert refusal("absent") is reason
        elif condition in ("released", "expired"):
            assert refusal(condition) is reason
        else:
            assert refusal("active", condition) is reason
    assert refusal("active", expires=NOW) is table[
        ("time", "grant expiry at or before store time")]
    scope_reason = table[("scopes", "requested not within both the grant's and the lease's "
                                    "scopes")]
    assert refusal("active", requested=("b", "z")) is scope_reason
    assert refusal("active") is None
    # In flight: by default the grant (10 days) expires before the lease (30 days).
    flight = {cond: reason for (check, cond), reason in table.items() if check == "in flight"}
    grant_first, lease_first = flight.values()
    day = 86400.0
    assert refusal("active", in_flight=10 * day - 0.001) is None
    assert refusal("active", in_flight=10 * day) is grant_first
    assert refusal("active", in_flight=10 * day, expires=NOW + timedelta(days=31)) is None
    assert refusal("active", in_flight=30 * day,
                   expires=NOW + timedelta(days=31)) is lease_first
    # The first rows need no lease: the ones a row would decide come after them.
    order = [r[0] for r in rows]
    assert order.index("store") < order.index("time") < order.index("lease")
    covered = set(table.values())
    assert covered >= {Reason.GRANT_UNKNOWN, Reason.STORE_UNAVAILABLE}
    assert re.search(r"\| - \| otherwise \| validated \|", SPEC.read_text())


def test_validation_order_around_the_read_and_the_slow_reply() -> None:
    table = {(r[0], r[1]): r[2] for r in _table("Validation")}
    held = _command("heartbeat", "match")
    assert isinstance(held, Heartbeat)
    command = Validate(IDENTITY, ("a",), IDENTITY, held.connector_id, held.lease_id,
                       held.epoch, ("a", "b"), NOW + timedelta(10), None, "spec")
    assert read_refusal(command, None, 0.0) is Reason(table[("store", "store cannot be read")])
    read = Snapshot(_row("active", "match"), NOW)
    assert read_refusal(command, read, 0.0) is None
    day = 86400.0
    slow = read_refusal(command, read, 10 * day)
    assert slow is Reason.GRANT_EXPIRED and slow_reply(command, read, slow, 10 * day)
    # Late only by the time it waited before its statement went out (coalesced behind
    # another read): answered in time, refused all the same, but no slow reply.
    queued = Snapshot(read.row, NOW, queued=10 * day - 1)
    assert read_refusal(command, queued, 10 * day) is Reason.GRANT_EXPIRED
    assert not slow_reply(command, queued, Reason.GRANT_EXPIRED, 10 * day)
    # Expired at the store's instant: an expiry, not a slow reply.
    stale = attrs.evolve(command, grant_expires_at=NOW)
    assert not slow_reply(stale, read, read_refusal(stale, read, 0.0), 0.0)
    assert not slow_reply(command, None, Reason.STORE_UNAVAILABLE, 0.0)
    assert not slow_reply(command, read, Reason.LEASE_REPLACED, 0.0)
    assert "slow reply" in SPEC.read_text()


def test_lost_replies_table_matches_is_own_write() -> None:
    rows = _table("Lost replies")[:8]
    assert {r[0] for r in rows} == {"acquire", "takeover", "heartbeat", "release"}
    for name, read, ours in rows:
        command = _command(name, "match")
        new_id: UUID = getattr(command, "new_lease_id", uuid4())
        if read == "no row":
            row = None
        else:
            row = _row("active", "match")
            assert row is not None
            if read == "carries the command's new lease id":
                row = attrs.evolve(row, lease_id=new_id)
        assert is_own_write(command, row) is (ours == "yes"), (name, read)


@pytest.mark.parametrize(("name", "epoch"), [("acquire", 1), ("takeover", 6),
                                             ("heartbeat", 5), ("release", 5)])
def test_reconciled_row_table(name: str, epoch: int) -> None:
    current, superseded = _table("Lost replies")[-2:]
    assert current[0].startswith("carries the write's lease id")
    assert superseded[0].startswith("carries another lease id or epoch")
    command = _command(name, "preempt" if name == "takeover" else "match")
    write = plan(command)
    assert write is not None
    lease_id = write.new_lease_id if isinstance(write, Rotate) else write.lease_id
    row = _row("active", "match")
    assert row is not None
    ours = attrs.evolve(row, lease_id=lease_id, epoch=epoch)
    assert reconciled_row(command, write, ours, NOW) is ours
    later = NOW + timedelta(seconds=3)
    other = attrs.evolve(row, lease_id=uuid4(), epoch=epoch + 1, connector_id="c7")
    reported = reconciled_row(command, write, other, later)
    assert (reported.lease_id, reported.epoch, reported.connector_id, reported.expires_at) == (
        lease_id, epoch, command.connector_id, later)
    assert reported.state(later) is LeaseState.EXPIRED
