"""The audit trail: exactly one row per lifecycle attempt, one per denied validation, none per
successful validation, and nothing secret in it or in the logs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    Outcome,
    PolicyRequest,
    PolicyVerdict,
    Reason,
    StaticConnectorPolicy,
)
from mos_lease.records import AuditEntry
from mos_lease.vocabulary import LifecycleEvent
from tests.helpers import IDENT, OTHER_IDENT, SCOPES, CountingIds, Env, FaultyStore, make_env

E = LifecycleEvent


def _one_row(env: Env, event: LifecycleEvent, outcome: Outcome,
             call: Callable[[], Any]) -> Any:
    before = env.audit()
    now = env.clock.now()
    result = call()
    after = env.audit()
    assert after[:len(before)] == before, "audit rows were changed or removed"
    new = after[len(before):]
    assert len(new) == 1, f"{event}: {len(new)} audit rows"
    (record,) = new
    assert (record.entry.event, record.entry.outcome) == (event, outcome)
    assert record.recorded_at == now
    assert record.seq == len(before) + 1
    reason = getattr(result, "reason", None)
    assert record.entry.reason == reason
    return result


def _no_row(env: Env, call: Callable[[], Any]) -> Any:
    before = env.audit()
    result = call()
    assert env.audit() == before
    return result


def test_every_lifecycle_attempt_appends_exactly_one_row() -> None:
    env = make_env()
    c = env.coordinator
    ok, no = Outcome, Outcome.DENIED
    lease = _one_row(env, E.ACQUIRE, ok.ACQUIRED, lambda: c.acquire(
        IDENT, "a", scopes=SCOPES, ttl=10, correlation_id="r1")).lease
    assert env.audit()[-1].entry == AuditEntry(
        env.audit()[-1].entry.event_id, E.ACQUIRE, ok.ACQUIRED, None, IDENT, "a", 1, "r1")
    _one_row(env, E.ACQUIRE, no, lambda: c.acquire(IDENT, "b", scopes=SCOPES, ttl=10))
    _one_row(env, E.HEARTBEAT, ok.RENEWED, lambda: c.heartbeat(lease, ttl=10))
    _one_row(env, E.HEARTBEAT, no, lambda: c.heartbeat(attrs.evolve(lease, epoch=5), ttl=10))
    grant = _one_row(env, E.GRANT_ISSUE, ok.GRANT_ISSUED, lambda: c.issue_grant(
        lease, scopes=["tool:run"], ttl=5)).grant
    _one_row(env, E.GRANT_ISSUE, no, lambda: c.issue_grant(lease, scopes=["x"], ttl=5))
    # Validation: success is not audited, every denial is.
    assert _no_row(env, lambda: c.validate(grant, identity=IDENT, scopes=["tool:run"])).ok
    calls: list[ConnectorExecutionContext] = []
    assert _no_row(env, lambda: c.invoke(grant, calls.append, identity=IDENT,
                                         scopes=["tool:run"])).ok
    _one_row(env, E.GRANT_VALIDATE, no, lambda: c.validate(
        grant, identity=IDENT, scopes=["tool:read", "tool:run", "tool:x"]))
    _one_row(env, E.GRANT_VALIDATE, no, lambda: c.invoke(
        attrs.evolve(grant), calls.append, identity=IDENT, scopes=[]))
    _one_row(env, E.GRANT_VALIDATE, no, lambda: c.validate(
        grant, identity=OTHER_IDENT, scopes=[]))
    _one_row(env, E.TAKEOVER, no, lambda: c.takeover(
        IDENT, "b", scopes=SCOPES, ttl=10, expected_epoch=7))
    taken = _one_row(env, E.TAKEOVER, ok.TAKEN_OVER, lambda: c.takeover(
        IDENT, "b", scopes=SCOPES, ttl=10, expected_epoch=1)).lease
    assert env.audit()[-1].entry.epoch == 2
    _one_row(env, E.RELEASE, no, lambda: c.release(lease))
    _one_row(env, E.RELEASE, ok.RELEASED, lambda: c.release(taken))
    assert env.audit()[-1].entry.epoch == 2
    _one_row(env, E.RELEASE, no, lambda: c.release(taken))
    # Policy refusals are lifecycle attempts too.
    deny = ConnectorLeaseCoordinator(env.store, id_source=CountingIds())
    _one_row(env, E.ACQUIRE, no, lambda: deny.acquire(OTHER_IDENT, "z", scopes=[], ttl=5))
    _one_row(env, E.TAKEOVER, no, lambda: deny.takeover(
        IDENT, "z", scopes=[], ttl=5, expected_epoch=2))
    _one_row(env, E.HEARTBEAT, no, lambda: deny.heartbeat(taken, ttl=5))
    _one_row(env, E.RELEASE, no, lambda: deny.release(taken))
    _one_row(env, E.GRANT_ISSUE, no, lambda: deny.issue_grant(taken, scopes=[], ttl=5))
    assert calls and len(calls) == 1
    records = env.audit()
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    assert len({r.entry.event_id for r in records}) == len(records)


def test_batched_heartbeats_audit_each_lease() -> None:
    env = make_env()
    first, second = env.acquire(), env.acquire(OTHER_IDENT)
    stale = attrs.evolve(first, epoch=3)
    before = len(env.audit())
    results = env.coordinator.heartbeat_many([first, stale, second], ttl=20)
    assert [r.reason for r in results] == [None, Reason.EPOCH_MISMATCH, None]
    new = env.audit()[before:]
    assert len(new) == 3
    assert sorted((r.entry.identity.binding_id, r.entry.outcome) for r in new) == [
        ("binding-1", Outcome.DENIED), ("binding-1", Outcome.RENEWED),
        ("binding-2", Outcome.RENEWED)]


def test_audit_entries_have_no_place_for_secrets() -> None:
    assert {f.name for f in attrs.fields(AuditEntry)} == {
        "event_id", "event", "outcome", "reason", "identity", "connector_id", "epoch",
        "correlation_id"}


# --- canaries --------------------------------------------------------------------------------

CANARY_SCOPE = "secret-canary-xyz"
CANARY_GRANT_SCOPE = "tool:secret-canary-grant"
CANARY_PAYLOAD = "payload-canary-7f3a9"
CANARY_POLICY = "policy-canary-token-41c2"
CANARIES = [CANARY_SCOPE, "canary-xyz", CANARY_GRANT_SCOPE, CANARY_PAYLOAD, CANARY_POLICY]


@attrs.define
class SecretHoldingPolicy:
    """A policy with credentials of its own; it allows everything and says so in its repr."""

    api_token: str = CANARY_POLICY
    rules: StaticConnectorPolicy = attrs.field(factory=lambda: StaticConnectorPolicy.from_dict(
        {"rules": [{"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*",
                    "connector_id": "*", "scopes": [CANARY_SCOPE, CANARY_GRANT_SCOPE],
                    "max_lease_ttl": 300, "max_grant_ttl": 30, "preempt_active": True}]}))

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        return self.rules.authorize(request)


def _run_everything_with_canaries(env: Env) -> list[Any]:
    c = env.coordinator
    out: list[Any] = []
    acquired = c.acquire(IDENT, "conn-a", scopes=[CANARY_SCOPE, CANARY_GRANT_SCOPE], ttl=60)
    lease = acquired.lease
    assert lease is not None
    out.append(acquired)
    out.append(c.acquire(IDENT, "conn-b", scopes=[CANARY_SCOPE], ttl=60))
    issued = c.issue_grant(lease, scopes=[CANARY_GRANT_SCOPE], ttl=10)
    grant = issued.grant
    assert grant is not None
    out.append(c.issue_grant(lease, scopes=[CANARY_GRANT_SCOPE, "tool:other"], ttl=10))

    def adapter(context: ConnectorExecutionContext) -> dict[str, str]:
        return {"body": CANARY_PAYLOAD, "scopes": ",".join(context.scopes)}

    invoked = c.invoke(grant, adapter, identity=IDENT, scopes=[CANARY_GRANT_SCOPE])
    assert invoked.ok and invoked.value == {"body": CANARY_PAYLOAD,
                                            "scopes": CANARY_GRANT_SCOPE}
    out.append(c.invoke(grant, adapter, identity=IDENT, scopes=[CANARY_SCOPE]))
    out.append(c.invoke(attrs.evolve(grant), adapter, identity=IDENT,
                        scopes=[CANARY_GRANT_SCOPE]))
    out.append(c.invoke(grant, adapter, identity=OTHER_IDENT, scopes=[CANARY_GRANT_SCOPE]))
    out.append(c.heartbeat(lease, ttl=30))
    taken = c.takeover(IDENT, "conn-b", scopes=[CANARY_SCOPE], ttl=30, expected_epoch=1)
    assert taken.lease is not None
    out.append(c.invoke(grant, adapter, identity=IDENT, scopes=[CANARY_GRANT_SCOPE]))
    out.append(c.heartbeat(lease, ttl=30))
    out.append(c.release(taken.lease))
    out.append(c.release(taken.lease))
    env.clock.advance(timedelta(seconds=31))
    out.append(c.invoke(grant, adapter, identity=IDENT, scopes=[CANARY_GRANT_SCOPE]))
    return out


def _assert_no_canary(text: str, where: str) -> None:
    for canary in CANARIES:
        assert canary not in text, f"canary {canary!r} leaked into {where}"


def test_canaries_never_reach_the_audit_log_or_the_logs(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mos_lease")
    env = make_env(SecretHoldingPolicy())
    _run_everything_with_canaries(env)
    # A fail-closed validation and a reconciled lost commit log warnings: check those too.
    faulty = FaultyStore(env.store)
    other = ConnectorLeaseCoordinator(faulty, SecretHoldingPolicy(), id_source=CountingIds())
    faulty.lose_commit = "after"
    lease = other.acquire(OTHER_IDENT, "conn-c", scopes=[CANARY_GRANT_SCOPE], ttl=60).lease
    assert lease is not None
    grant = other.issue_grant(lease, scopes=[CANARY_GRANT_SCOPE], ttl=5).grant
    assert grant is not None
    faulty.fail_load = True
    assert other.validate(grant, identity=OTHER_IDENT,
                          scopes=[CANARY_GRANT_SCOPE]).reason is Reason.STORE_UNAVAILABLE

    records = env.audit()
    assert len(records) >= 15
    assert {r.entry.outcome for r in records} >= {Outcome.DENIED, Outcome.ACQUIRED,
                                                  Outcome.GRANT_ISSUED, Outcome.TAKEN_OVER}
    for record in records:
        _assert_no_canary(repr(record), "the audit log")
        _assert_no_canary(str(record), "the audit log")
        for field in attrs.fields(AuditEntry):
            _assert_no_canary(repr(getattr(record.entry, field.name)), "an audit field")
    ours = [r for r in caplog.records if r.name.startswith("mos_lease")]
    assert ours, "expected the coordinator to log its denials"
    assert any(r.levelno == logging.WARNING for r in ours)
    for log_record in ours:
        _assert_no_canary(log_record.getMessage(), "a log message")
        _assert_no_canary(repr(log_record.args), "log arguments")
    _assert_no_canary(caplog.text, "the captured log")


def test_the_canary_check_itself_can_fail() -> None:
    """The canary scope really is carried by the lease and the grant, so an audit or log
    line that printed scopes would contain it."""
    env = make_env(AllowAllPolicy())
    lease = env.acquire(scopes=[CANARY_SCOPE])
    assert CANARY_SCOPE in repr(lease)
    grant = env.coordinator.issue_grant(lease, scopes=[CANARY_SCOPE], ttl=5).grant
    assert CANARY_SCOPE in repr(grant)
    with pytest.raises(AssertionError):
        _assert_no_canary(repr(LeaseHandle.of(env.rows()[0])), "a row")


# --- the store's own audit guarantees ----------------------------------------------------------


def test_a_refused_audit_append_leaves_no_state_change() -> None:
    """The memory store writes the row before appending its audit entry; when the append is
    refused (a repeated event id, e.g. from a broken id source) the lease row is changed
    anyway and the change has no audit row."""
    env = make_env()
    env.acquire()
    twin = ConnectorLeaseCoordinator(env.store, AllowAllPolicy(),
                                     id_source=CountingIds(env.ids.prefix))
    before = env.state()
    with pytest.raises(ValueError, match="recorded twice"):
        twin.acquire(OTHER_IDENT, "conn-b", scopes=[], ttl=10)
    assert env.state() == before


def test_audit_paging() -> None:
    env = make_env()
    env.acquire()
    env.acquire(OTHER_IDENT)
    env.coordinator.acquire(IDENT, "conn-z", scopes=[], ttl=10)
    all_rows = list(env.store.audit())
    assert [r.seq for r in all_rows] == [1, 2, 3]
    assert list(env.store.audit(after_seq=1)) == all_rows[1:]
    assert list(env.store.audit(limit=1)) == all_rows[:1]
    assert [r.seq for r in env.store.audit(IDENT)] == [1, 3]
    assert [r.seq for r in env.store.audit(IDENT, after_seq=1)] == [3]


def test_audit_paging_arguments_are_checked_like_the_postgres_store() -> None:
    """The PostgreSQL inspector refuses a limit outside 1..1_000_000 and a negative
    ``after_seq``; the in-memory reference store silently slices (``limit=-1`` drops the
    newest row)."""
    env = make_env()
    env.acquire()
    env.acquire(OTHER_IDENT)
    accepted = []
    bad: list[tuple[str, dict[str, Any]]] = [
        ("limit", {"limit": -1}), ("limit", {"limit": 0}), ("limit", {"limit": True}),
        ("limit", {"limit": "5"}), ("limit", {"limit": 1_000_001}),
        ("after_seq", {"after_seq": -1}), ("after_seq", {"after_seq": 1.5}),
        ("identity", {"identity": "acme/agent-1/binding-1"}),
    ]
    for field, kwargs in bad:
        try:
            got = env.store.audit(**kwargs)
        except InvalidInput as refused:
            assert refused.field == field
            continue
        except Exception as crash:  # anything but InvalidInput is wrong too
            accepted.append(f"{kwargs} -> {type(crash).__name__}")
            continue
        accepted.append(f"{kwargs} -> {len(got)} rows")
    assert accepted == []


# --- telemetry: events, keeper log lines, OpenTelemetry attributes -----------------------------


def test_events_have_no_place_for_secrets() -> None:
    from mos_lease.events import Lost, OperationFinished, RenewalRetry, Renewed, StoreCall

    ids = {"tenant_id", "logical_agent_id", "binding_id", "connector_id", "epoch"}
    fields = {kind.__name__: {f.name for f in attrs.fields(kind)} for kind in (
        OperationFinished, StoreCall, Renewed, RenewalRetry, Lost)}
    assert fields == {
        "OperationFinished": ids | {"operation", "outcome", "reason", "duration",
                                    "correlation_id"},
        "StoreCall": {"operation", "system", "started_ns", "duration", "error",
                      "batch_size"},
        "Renewed": ids | {"duration"},
        "RenewalRetry": ids | {"cause", "attempt", "delay"},
        "Lost": ids | {"cause", "reason"},
    }
