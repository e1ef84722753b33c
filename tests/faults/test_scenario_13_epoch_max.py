"""Scenario 13: epoch at the bigint maximum -> takeover refused with its reason; no wrap.

An identity's epoch is raised to 2**63 - 2 directly in the table (as an operator restoring a
row would; no library call reaches it in test time). Eight processes race to take it over:
exactly one reaches 2**63 - 1. From then on every takeover, preempting or after expiry or
release, is refused with ``epoch_exhausted`` and leaves the row as it is, while the holder at
the maximum keeps working (heartbeat, grant, validation, release). Nothing in the lease table
or the audit log ever holds an epoch outside 1..2**63 - 1. The in-memory store is checked the
same way.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    Reason,
)
from mos_lease.clock import ManualClock
from mos_lease.identity import MAX_EPOCH
from mos_lease.records import LeaseRow
from mos_lease_memory import InMemoryLeaseStore
from tests.faults.gateway import SCOPES, Gateway
from tests.faults.history import Ident, Op, Status, check_history, read_records
from tests.faults.support import (
    Table,
    Worker,
    audit_rows,
    final_rows,
    run_prefix,
    set_epoch,
    start_together,
    workers_cleanup,
)

pytestmark = [pytest.mark.faults, pytest.mark.pg]

RACERS = 8


def _row(admin: psycopg.Connection[Any], identity: LeaseIdentity) -> tuple[Any, ...]:
    row = admin.execute("SELECT lease_id, connector_id, epoch, expires_at, released_at "
                        "FROM logical_agent_connector_leases WHERE tenant_id = %s AND "
                        "logical_agent_id = %s AND binding_id = %s",
                        (identity.tenant_id, identity.logical_agent_id,
                         identity.binding_id)).fetchone()
    assert row is not None
    return tuple(row)


@dataclass
class AfterTop:
    refused: Counter[str] = field(default_factory=Counter)
    holder_ok: list[bool] = field(default_factory=list)
    unchanged: bool = True
    beyond: str = ""
    raw: str = ""


def _after_the_top(pg_dsn: str, admin: psycopg.Connection[Any], tmp_path: Path, gw: Gateway,
                   identity: LeaseIdentity, key: Ident, connector: str) -> AfterTop:
    """The holder at the maximum still works; every takeover is refused, nothing moves."""
    out = AfterTop()
    holder = Gateway({"dsn": pg_dsn, "process": "holder", "connector": connector,
                      "records": str(tmp_path / "holder.jsonl")})
    try:
        snapshot = holder.store.load(identity)
        assert snapshot.row is not None
        lease = LeaseHandle.of(snapshot.row)
        for _ in range(3):
            before = _row(admin, identity)
            result = gw.takeover(identity, ttl=30, expected_epoch=MAX_EPOCH)  # preempting
            out.refused[str(result.reason if result else "error")] += 1
            out.unchanged &= _row(admin, identity) == before
        beat = holder.heartbeat(lease, ttl=1)
        out.holder_ok.append(bool(beat and beat.ok))
        granted = holder.issue_grant(lease, ttl=1)
        out.holder_ok.append(bool(granted and granted.ok))
        if granted is not None and granted.grant is not None:
            checked = holder.validate(granted.grant)
            out.holder_ok.append(bool(checked and checked.ok))
        released = holder.release(lease)
        out.holder_ok.append(bool(released and released.ok))
        for expected in (MAX_EPOCH, MAX_EPOCH - 1):  # after release; and a stale expectation
            before = _row(admin, identity)
            result = gw.takeover(identity, ttl=30, expected_epoch=expected)
            out.refused[str(result.reason if result else "error")] += 1
            out.unchanged &= _row(admin, identity) == before
        acquired = gw.acquire(identity, ttl=30)
        out.refused[str(acquired.reason if acquired else "error")] += 1
        try:
            gw.coordinator.takeover(identity, "setup", scopes=SCOPES, ttl=30,
                                    expected_epoch=MAX_EPOCH + 1)
            out.beyond = "accepted"
        except InvalidInput:
            out.beyond = "InvalidInput"
        # The database itself refuses an epoch past the maximum.
        try:
            with admin.transaction():
                admin.execute("UPDATE logical_agent_connector_leases SET epoch = epoch + 1 "
                              "WHERE tenant_id = %s AND logical_agent_id = %s AND "
                              "binding_id = %s", key)
            out.raw = "succeeded"
        except psycopg.errors.NumericValueOutOfRange:
            out.raw = "out of range"
    finally:
        holder.close()
        gw.close()
    return out


def test_epoch_at_bigint_max(pg_dsn: str, admin: psycopg.Connection[Any], figures: Table,
                             tmp_path: Path) -> None:
    prefix = run_prefix("s13")
    identity = LeaseIdentity(prefix, "agent", "top")
    key = (identity.tenant_id, identity.logical_agent_id, identity.binding_id)
    # The row is created, then lifted to MAX - 1 behind the library's back; the checker
    # starts from there (this acquisition and its audit row are not part of the history).
    prep = Gateway({"dsn": pg_dsn, "process": "prep", "connector": "prep",
                    "records": str(tmp_path / "prep.log")})
    got = prep.acquire(identity, ttl=0.3)
    prep.close()
    assert got is not None and got.ok
    set_epoch(admin, key, MAX_EPOCH - 1)
    gw = Gateway({"dsn": pg_dsn, "process": "setup", "connector": "setup",
                  "records": str(tmp_path / "setup.jsonl")})
    time.sleep(0.4)  # the lease at MAX - 1 expires: every racer may take it over
    with workers_cleanup() as made:
        for p in range(RACERS):
            made.append(Worker("storm", {
                "dsn": pg_dsn, "process": f"racer{p}", "tenant": prefix, "bindings": ["top"],
                "rounds": 6, "validators": 0, "records": str(tmp_path / f"racer{p}.jsonl"),
                "max_seconds": 60,
            }, tmp_path))
        start_together(made)
        for worker in made:
            worker.finish(120)

    records = read_records(tmp_path.glob("racer*.jsonl"))
    takeovers = [r for r in records if r.op is Op.TAKEOVER]
    winners = [r for r in takeovers if r.status is Status.OK]
    reasons = Counter(r.reason for r in takeovers if r.status is Status.DENIED)
    at_top = _row(admin, identity)

    after = _after_the_top(pg_dsn, admin, tmp_path, gw, identity, key,
                           winners[0].connector_id if winners else "none")
    refused_later, holder_ok, unchanged = after.refused, after.holder_ok, after.unchanged
    beyond, raw = after.beyond, after.raw

    out_of_range = admin.execute(
        "SELECT (SELECT count(*) FROM logical_agent_connector_leases WHERE "
        "starts_with(tenant_id, %s) AND epoch < 1) + (SELECT count(*) FROM "
        "connector_lease_audit_log WHERE starts_with(tenant_id, %s) AND epoch < 1)",
        (prefix, prefix)).fetchone()
    records = read_records(tmp_path.glob("*.jsonl"))
    audit = [a for a in audit_rows(admin, prefix) if a.correlation_id != got.correlation_id]
    violations = check_history(records, audit,
                               final_rows=final_rows(admin, prefix),
                               initial_epochs={key: MAX_EPOCH - 1})
    memory = _memory_check()

    figures.add("racers at epoch 2**63 - 2", f"{RACERS} processes, {len(takeovers)} takeovers")
    figures.add("winners of the last epoch", len(winners), "1", len(winners) == 1)
    figures.add("epoch after the race", at_top[2], f"= {MAX_EPOCH}", at_top[2] == MAX_EPOCH)
    figures.add("racers refused", dict(reasons.most_common()), "epoch_exhausted among them",
                reasons[str(Reason.EPOCH_EXHAUSTED)] > 0)
    figures.add("later takeovers / acquire", dict(refused_later.most_common()),
                "epoch_exhausted; stale: epoch_mismatch; acquire: takeover_required",
                refused_later == Counter({"epoch_exhausted": 4, "epoch_mismatch": 1,
                                          "takeover_required": 1}))
    figures.add("row unchanged by refused takeovers", unchanged, "True", unchanged)
    figures.add("holder at the maximum: heartbeat, grant, validate, release", holder_ok,
                "all True", all(holder_ok) and len(holder_ok) == 4)
    figures.add("expected_epoch = 2**63", beyond, "InvalidInput", beyond == "InvalidInput")
    figures.add("raw UPDATE past the maximum", raw, "out of range", raw == "out of range")
    wrapped = out_of_range[0] if out_of_range is not None else -1
    figures.add("epochs < 1 anywhere (a wrap)", wrapped, "0", wrapped == 0)
    figures.add("in-memory store: same checks", memory, "ok", memory == "ok")
    figures.add("history checker violations", len(violations), "0", not violations)
    figures.notes += [str(v) for v in violations[:10]]
    assert not figures.failed(), figures.render()


def _memory_check() -> str:
    clock = ManualClock()
    store = InMemoryLeaseStore(clock)
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity("memory", "agent", "top")
    got = coordinator.acquire(identity, "a", scopes=SCOPES, ttl=1)
    assert got.lease is not None
    row = store._rows[identity]
    store._rows[identity] = LeaseRow(
        identity=identity, lease_id=row.lease_id, connector_id="a", scopes=row.scopes,
        epoch=MAX_EPOCH - 1, acquired_at=row.acquired_at, heartbeat_at=row.heartbeat_at,
        expires_at=row.expires_at, released_at=None, updated_at=datetime.now(UTC))
    clock.advance(2)
    first = coordinator.takeover(identity, "b", scopes=SCOPES, ttl=5,
                                 expected_epoch=MAX_EPOCH - 1)
    second = coordinator.takeover(identity, "c", scopes=SCOPES, ttl=5, expected_epoch=MAX_EPOCH)
    if not first.ok or first.current_epoch != MAX_EPOCH:
        return f"takeover to the maximum: {first}"
    if second.reason is not Reason.EPOCH_EXHAUSTED:
        return f"takeover at the maximum: {second}"
    if store._rows[identity].epoch != MAX_EPOCH:
        return "row moved"
    return "ok"
