"""Batched acquires, takeovers, releases and holder reads on PostgreSQL: one statement per
batch, each item guarded, refused and audited on its own, a locked row skipped rather than
waited for, and a batch racing a single takeover leaves exactly one winner."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from psycopg import sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.errors import InvalidInput
from mos_lease.events import StoreCall
from mos_lease.identity import MAX_EPOCH
from mos_lease.ids import uuid7
from mos_lease.machine import Close, Rotate, Write
from mos_lease.records import AuditEntry
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason
from mos_lease_pg import ConnectionSettings, batch_statements, sql_files
from mos_lease_pg.statements import notice_channel
from tests.faults.support import set_epoch
from tests.pg.test_pg_lock_first import _subplan
from tests.pg.test_pg_notices import heard
from tests.pg_fixtures import StoreFactory
from tests.pg_support import FaultProxy

pytestmark = pytest.mark.pg

N = 300

TABLE = sql.Identifier(sql_files.DEFAULT_SCHEMA, "logical_agent_connector_leases")
SHARE_ROW = sql.SQL("SELECT 1 FROM {} WHERE tenant_id = %s AND logical_agent_id = %s "
                    "AND binding_id = %s FOR SHARE").format(TABLE)


class Calls:
    """The store calls a coordinator made, by name (its telemetry hook)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, event: object) -> None:
        if isinstance(event, StoreCall):
            self.names.append(event.operation)

    def take(self) -> list[str]:
        names, self.names = self.names, []
        return names


def _keys(tenant: str, n: int = N) -> list[LeaseIdentity]:
    return [LeaseIdentity(tenant, "agent", f"b{i:04d}") for i in range(n)]


def test_each_batch_is_one_statement_and_every_item_is_audited(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    calls = Calls()
    store = pg_stores()
    first = ConnectorLeaseCoordinator(store, AllowAllPolicy(), on_event=calls)
    keys = _keys(pg_tenant)
    acquired = first.acquire_many(keys, "c1", scopes=["s"], ttl=60,
                                  metadata={"endpoint": "gw-1"})
    assert calls.take() == ["acquire_many"]
    assert all(r.outcome is Outcome.ACQUIRED and r.current_epoch == 1 for r in acquired)

    survivor = ConnectorLeaseCoordinator(store, AllowAllPolicy(), on_event=calls)
    views = survivor.current_holders(keys)
    assert calls.take() == ["load_many"]
    assert all(v is not None and v.connector_id == "c1" and v.metadata == {"endpoint": "gw-1"}
               for v in views)
    taken = survivor.takeover_many([(key, 1) for key in keys], "c2", scopes=["s", "t"], ttl=60,
                                   observed=views)
    assert calls.take() == ["takeover_many"]
    assert all(r.outcome is Outcome.TAKEN_OVER and r.current_epoch == 2 for r in taken)
    leases = [r.lease for r in taken]
    assert len({lease.lease_id for lease in leases if lease is not None}) == N

    released = survivor.release_many([lease for lease in leases if lease is not None])
    assert calls.take() == ["release_many"]
    assert all(r.outcome is Outcome.RELEASED and r.current_epoch == 2 for r in released)

    rows = {row.identity: row for row in store.leases(pg_tenant)}
    assert all(rows[key].epoch == 2 and rows[key].released_at is not None
               and rows[key].connector_id == "c2" and rows[key].scopes == ("s", "t")
               and not rows[key].metadata for key in keys)
    audit = store.audit(keys[17])
    assert [(r.entry.outcome, r.entry.epoch) for r in audit] == [
        (Outcome.ACQUIRED, 1), (Outcome.TAKEN_OVER, 2), (Outcome.RELEASED, 2)]
    assert audit[1].recorded_at == rows[keys[17]].acquired_at


def test_a_mixed_batch_refuses_each_item_for_its_own_reason(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    keys = _keys(pg_tenant, 6)
    held = gateway.acquire_many(keys[:5], "c1", scopes=[], ttl=60)
    assert gateway.release(held[1].lease).ok  # type: ignore[arg-type]
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        set_epoch(admin, (pg_tenant, "agent", keys[4].binding_id), MAX_EPOCH)
    calls = Calls()
    survivor = ConnectorLeaseCoordinator(store, AllowAllPolicy(), on_event=calls)
    results = survivor.takeover_many(
        [(keys[0], 1), (keys[1], 1), (keys[2], 7), (keys[3], 1), (keys[4], MAX_EPOCH),
         (keys[5], 1)], "c2", scopes=[], ttl=60)
    # One read for the policy; the refusals it already shows are audited as a single
    # takeover that read first audits them; one write for the rest.
    assert calls.take() == ["load_many", "record", "record", "record", "takeover_many"]
    assert [(r.outcome, r.reason) for r in results] == [
        (Outcome.TAKEN_OVER, None), (Outcome.TAKEN_OVER, None),
        (Outcome.DENIED, Reason.EPOCH_MISMATCH), (Outcome.TAKEN_OVER, None),
        (Outcome.DENIED, Reason.EPOCH_EXHAUSTED), (Outcome.DENIED, Reason.LEASE_MISSING)]
    assert results[2].current_epoch == 1 and results[2].holder is not None
    assert [r.entry.outcome for r in store.audit(keys[2])] == [Outcome.ACQUIRED,
                                                              Outcome.DENIED]
    assert store.audit(keys[2])[-1].entry.reason is Reason.EPOCH_MISMATCH

    # The acquire side: an active row is lease_held, a released one takeover_required.
    again = survivor.acquire_many([*keys[:2], LeaseIdentity(pg_tenant, "agent", "new")], "c3",
                                  scopes=[], ttl=60)
    gateway.release(results[1].lease)  # type: ignore[arg-type]
    assert [(r.outcome, r.reason) for r in again] == [
        (Outcome.DENIED, Reason.LEASE_HELD), (Outcome.DENIED, Reason.LEASE_HELD),
        (Outcome.ACQUIRED, None)]
    assert survivor.acquire_many([keys[1]], "c3", scopes=[], ttl=60)[0].reason is \
        Reason.TAKEOVER_REQUIRED
    assert [(r.entry.outcome, r.entry.reason) for r in store.audit(keys[1])][-3:] == [
        (Outcome.DENIED, Reason.LEASE_HELD), (Outcome.RELEASED, None),
        (Outcome.DENIED, Reason.TAKEOVER_REQUIRED)]


def test_refusals_found_by_the_batch_write_are_named_from_the_rows_it_locked(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    """Views taken, then rows moved on: the one write refuses those items and names each
    refusal from the row it locked (no second read), audited per item."""
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    keys = _keys(pg_tenant, 4)
    leases = [r.lease for r in gateway.acquire_many(keys, "c1", scopes=[], ttl=60)]
    calls = Calls()
    survivor = ConnectorLeaseCoordinator(store, AllowAllPolicy(), on_event=calls)
    views = survivor.current_holders(keys)
    assert gateway.takeover(keys[1], "c9", scopes=[], ttl=60, expected_epoch=1).ok
    calls.take()
    results = survivor.takeover_many([(key, 1) for key in keys], "c2", scopes=[], ttl=60,
                                     observed=views)
    assert calls.take() == ["takeover_many", "record"]
    assert [r.reason for r in results] == [None, Reason.EPOCH_MISMATCH, None, None]
    assert results[1].current_epoch == 2 and results[1].holder is not None
    assert results[1].holder.connector_id == "c9"
    # The released side: the old holder's handles are stale now, each refused in the
    # write, named from its locked row, audited on its own.
    released = survivor.release_many([lease for lease in leases if lease is not None])
    assert calls.take() == ["release_many", "record", "record", "record", "record"]
    assert {r.reason for r in released} == {Reason.STALE_EPOCH}
    assert [r.entry.reason for r in store.audit(keys[0])][-1] is Reason.STALE_EPOCH


def test_a_takeover_judged_on_a_stale_view_is_refused_by_the_store(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    """The view says expired, so no preemption was asked for; the row was renewed since:
    the write's guard refuses it (``preemption_denied``), named from the row it locked."""
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    key = _keys(pg_tenant, 1)[0]
    lease = gateway.acquire(key, "c1", scopes=[], ttl=1).lease
    assert lease is not None
    store.advance(2)
    view = gateway.current_holder(key)
    assert view is not None and view.state.value == "expired"
    assert gateway.takeover(key, "c0", scopes=[], ttl=60, expected_epoch=1).ok
    # The view is of epoch 1; the row is at epoch 2 and active now.
    result = gateway.takeover_many([(key, 1)], "c2", scopes=[], ttl=60, observed=[view])[0]
    assert result.reason is Reason.EPOCH_MISMATCH and result.current_epoch == 2


def test_a_locked_row_is_not_reached_and_the_rest_are_taken_over(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    keys = _keys(pg_tenant, 10)
    gateway.acquire_many(keys, "c1", scopes=[], ttl=60)
    views = gateway.current_holders(keys)
    held = keys[4]
    with psycopg.connect(pg_dsn) as blocker:
        blocker.execute(SHARE_ROW, (held.tenant_id, held.logical_agent_id, held.binding_id))
        began = time.monotonic()
        results = gateway.takeover_many([(key, 1) for key in keys], "c2", scopes=[], ttl=60,
                                        observed=views)
        took = time.monotonic() - began
        blocker.commit()
    assert took < 1.0, took  # no lock wait (lock_timeout would have failed it all)
    assert [r.reason for r in results] == [Reason.STORE_UNAVAILABLE if key == held else None
                                           for key in keys]
    assert [r.entry.outcome for r in store.audit(held)] == [Outcome.ACQUIRED]  # unjudged
    assert store.load(held).row.epoch == 1  # type: ignore[union-attr]
    retried = gateway.takeover_many([(held, 1)], "c2", scopes=[], ttl=60)
    assert retried[0].outcome is Outcome.TAKEN_OVER


def test_a_batch_racing_a_single_takeover_leaves_one_winner_per_row(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    setup = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    failures: list[BaseException] = []
    for round_ in range(8):
        keys = _keys(f"{pg_tenant}-{round_}", 50)
        setup.acquire_many(keys, "c1", scopes=[], ttl=60)
        contested = keys[round_ * 3]
        start = threading.Barrier(2)
        outcome: dict[str, Any] = {}

        def batch(keys: list[LeaseIdentity] = keys, outcome: dict[str, Any] = outcome,
                  start: threading.Barrier = start) -> None:
            try:
                gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
                start.wait()
                outcome["batch"] = gateway.takeover_many([(k, 1) for k in keys], "batch",
                                                         scopes=[], ttl=60)
            except BaseException as failure:
                failures.append(failure)

        def single(contested: LeaseIdentity = contested, outcome: dict[str, Any] = outcome,
                   start: threading.Barrier = start) -> None:
            try:
                gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
                start.wait()
                outcome["single"] = gateway.takeover(contested, "single", scopes=[], ttl=60,
                                                     expected_epoch=1)
            except BaseException as failure:
                failures.append(failure)

        threads = [threading.Thread(target=batch), threading.Thread(target=single)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not failures, failures
        mine = outcome["batch"][round_ * 3]
        theirs = outcome["single"]
        assert mine.ok != theirs.ok, (mine, theirs)
        loser = theirs if mine.ok else mine
        assert loser.reason in (Reason.EPOCH_MISMATCH, Reason.STORE_UNAVAILABLE), loser
        row = setup.store.load(contested).row
        assert row is not None and row.epoch == 2
        assert row.connector_id == ("batch" if mine.ok else "single")
        winners = [r for r in setup.store.audit(contested)  # type: ignore[attr-defined]
                   if r.entry.outcome is Outcome.TAKEN_OVER]
        assert len(winners) == 1
        assert all(r.ok for i, r in enumerate(outcome["batch"]) if i != round_ * 3)


def test_bad_batches_are_refused_before_anything_is_written(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    key = _keys(pg_tenant, 1)[0]
    with pytest.raises(InvalidInput, match="twice"):
        gateway.acquire_many([key, key], "c1", scopes=[], ttl=60)
    with pytest.raises(InvalidInput, match="identities"):
        gateway.acquire_many(key, "c1", scopes=[], ttl=60)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="targets"):
        gateway.takeover_many([key], "c1", scopes=[], ttl=60)  # type: ignore[list-item]
    with pytest.raises(InvalidInput, match="at most 1000"):
        gateway.current_holders(_keys(pg_tenant, 1001))
    assert store.leases(pg_tenant) == []
    assert store.audit(key) == []


@pytest.mark.faults
@pytest.mark.parametrize("lose", ["reply", "request"])
def test_a_lost_takeover_batch_is_reconciled_item_by_item_by_its_lease_uuids(
        lose: str, proxy: FaultProxy, pg_stores: StoreFactory, pg_tenant: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The batch statement's reply (or the statement itself) is lost on the wire: each
    takeover is settled by its own event id, then recognized by the lease UUID it carried;
    none is applied twice and none is reported lost when it committed."""
    observer = pg_stores()
    keys = _keys(pg_tenant, 5)
    ConnectorLeaseCoordinator(observer, AllowAllPolicy()).acquire_many(keys, "c1", scopes=[],
                                                                       ttl=60)
    survivor = ConnectorLeaseCoordinator(
        pg_stores(proxy.dsn, settings=ConnectionSettings(prepare=False)), AllowAllPolicy())
    views = survivor.current_holders(keys)
    # Only the batched takeover's statement names a request row's new lease UUID.
    if lose == "reply":
        proxy.cut_reply_to(b"r.new_lease_id")
    else:
        proxy.cut_request(b"r.new_lease_id")
    with caplog.at_level(logging.WARNING, logger="mos_lease"):
        results = survivor.takeover_many([(key, 1) for key in keys], "c2", scopes=[], ttl=60,
                                         observed=views)
    assert all(r.outcome is Outcome.TAKEN_OVER and r.current_epoch == 2 for r in results)
    assert all(r.reconciled for r in results) == (lose == "reply")
    assert caplog.text.count(f"committed={lose == 'reply'}") == len(keys)
    for key, result in zip(keys, results, strict=True):
        row = observer.load(key).row
        assert row is not None and result.lease is not None
        assert (row.epoch, row.lease_id) == (2, result.lease.lease_id)
        outcomes = [r.entry.outcome for r in observer.audit(key)]
        assert outcomes == [Outcome.ACQUIRED, Outcome.TAKEN_OVER]


def test_each_takeover_and_release_of_a_batch_sends_its_own_notice(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    """As a single takeover or release does: the same payload, one per write applied, none
    for an acquire or a refused write."""
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    keys = _keys(pg_tenant, 3)
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notice_channel())))
        gateway.acquire_many(keys, "c1", scopes=[], ttl=60)
        views = gateway.current_holders(keys)
        taken = gateway.takeover_many([(keys[0], 1), (keys[1], 1), (keys[2], 5)], "c2",
                                      scopes=[], ttl=60, observed=[*views[:2], None])
        assert [r.ok for r in taken] == [True, True, False]
        got = sorted(data["b"] + data["k"] + str(data["e"])
                     for _c, _p, data in heard(listener, pg_tenant, expect=2))
        assert got == [f"{keys[0].binding_id}takeover2", f"{keys[1].binding_id}takeover2"]
        leases = [r.lease for r in taken if r.lease is not None]
        gateway.release_many(leases)
        released = heard(listener, pg_tenant, expect=2)
        assert sorted(data["b"] for _c, _p, data in released) == [k.binding_id
                                                                  for k in keys[:2]]
        assert all(data == {"t": pg_tenant, "a": "agent", "b": data["b"], "e": 2,
                            "k": "release"} for _c, _p, data in released)
        assert not any(str(lease.lease_id) in payload
                       for lease in leases for _c, payload, _d in released)


@pytest.mark.parametrize("name", ["takeover_many", "release_many"])
def test_a_batch_plan_locks_the_rows_before_it_reads_the_clock(
        name: str, pg_admin: psycopg.Connection[Any]) -> None:
    """As test_pg_lock_first checks of the single writes: the clock CTE's only input is the
    locking CTE (a LockRows node, skipping rows held elsewhere)."""
    keys = [LeaseIdentity("plan", "agent", f"b{i}") for i in range(2)]
    ttl = timedelta(seconds=2)
    writes: list[Write] = ([Rotate(key, 1, False, uuid4(), "c", ("s",), ttl) for key in keys]
                           if name == "takeover_many" else
                           [Close(key, "c", uuid4(), 1) for key in keys])
    entries = [AuditEntry(uuid7(), *((LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER, None, key,
                                      "c", 2) if name == "takeover_many" else
                                     (LifecycleEvent.RELEASE, Outcome.RELEASED, None, key,
                                      "c", 1)), "corr") for key in keys]
    call = batch_statements.write_many(list(zip(writes, entries, strict=True)),
                                       timedelta(0))
    rows = pg_admin.execute(b"EXPLAIN (COSTS OFF) " + call.statement.text,
                            dict(call.params)).fetchall()
    plan = "\n".join(row[0] for row in rows)
    assert plan.index("CTE locked") < plan.index("CTE t"), plan
    assert "LockRows" in _subplan(plan, "CTE locked"), plan
    assert "CTE Scan on locked" in _subplan(plan, "CTE t"), plan
    assert "SKIP LOCKED" in call.statement.text.decode()
