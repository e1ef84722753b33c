"""The audit record's set form (migration 0011): a batch appended in one step keeps every
promise of one record per call (an id once, the first entry of an id within the batch, a
resend racing its first attempt answered 0, never a second row), refuses what it cannot
append whole, and writes nothing then."""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors

from mos_lease.ids import uuid7
from mos_lease_pg import statements

SCHEMA = "mos_lease"


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True)


def _batch(tenant: str, event_ids: list[Any], binding: str = "b") -> dict[str, Any]:
    n = len(event_ids)
    return {"offset": timedelta(0), "event_ids": event_ids, "events": ["grant_issue"] * n,
            "outcomes": ["grant_issued"] * n, "reasons": [None] * n,
            "tenant_ids": [tenant] * n, "logical_agent_ids": ["a"] * n,
            "binding_ids": [binding] * n, "connector_ids": ["c"] * n, "epochs": [1] * n,
            "correlation_ids": [f"corr-{i}" for i in range(n)]}


def _append(conn: psycopg.Connection[Any], params: dict[str, Any]) -> list[int]:
    rows = conn.execute(statements.RECORD_MANY.at(SCHEMA).text, params).fetchall()
    return [int(r[0]) for r in rows]


def _rows(conn: psycopg.Connection[Any], tenant: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT event_id, correlation_id FROM mos_lease.connector_lease_audit_log"
        " WHERE tenant_id = %s ORDER BY seq", (tenant,)).fetchall()


def test_a_batch_appends_each_entry_in_order_and_an_id_once(pg_dsn: str,
                                                            pg_tenant: str) -> None:
    ids = [uuid7() for _ in range(4)]
    with _connect(pg_dsn) as conn:
        # The same id twice in one batch: the first entry appends, the second finds it taken.
        assert _append(conn, _batch(pg_tenant, [ids[0], ids[1], ids[0], ids[2]])) == [1, 1, 0, 1]
        assert _rows(conn, pg_tenant) == [(ids[0], "corr-0"), (ids[1], "corr-1"),
                                          (ids[2], "corr-3")]
        # A resend, with one new entry among them: only the new one appends.
        assert _append(conn, _batch(pg_tenant, [ids[1], ids[3], ids[2]])) == [0, 1, 0]
        assert [r[0] for r in _rows(conn, pg_tenant)] == [ids[0], ids[1], ids[2], ids[3]]


@pytest.mark.parametrize("short", ["outcomes", "epochs", "correlation_ids"])
def test_arrays_of_different_lengths_are_refused_and_write_nothing(
        pg_dsn: str, pg_tenant: str, short: str) -> None:
    params = _batch(pg_tenant, [uuid7() for _ in range(3)])
    params[short] = params[short][:2]
    with _connect(pg_dsn) as conn:
        with pytest.raises(errors.InvalidParameterValue, match="differ in length"):
            _append(conn, params)
        assert _rows(conn, pg_tenant) == []


def test_the_one_record_form_appends_only_to_its_own_schemas_log(pg_dsn: str,
                                                                 pg_tenant: str) -> None:
    with _connect(pg_dsn) as conn:
        conn.execute("CREATE TEMP TABLE other_log (LIKE mos_lease.connector_lease_audit_log)")
        call = ("SELECT mos_lease.mos_lease_record_audit(%s::regclass, %s, 'grant_issue', "
                "'grant_issued', NULL, %s, 'a', 'b', 'c', 1, 'corr', clock_timestamp())")
        with pytest.raises(errors.InvalidParameterValue, match="records are appended to"):
            conn.execute(call, ("other_log", uuid7(), pg_tenant))
        event_id = uuid7()
        assert conn.execute(call, ("mos_lease.connector_lease_audit_log", event_id,
                                   pg_tenant)).fetchone() == (1,)
        assert conn.execute(call, ("mos_lease.connector_lease_audit_log", event_id,
                                   pg_tenant)).fetchone() == (0,)
        assert [r[0] for r in _rows(conn, pg_tenant)] == [event_id]


def test_batches_racing_over_the_same_ids_log_each_once_without_deadlock(
        pg_dsn: str, pg_tenant: str) -> None:
    # Sessions append overlapping batches of the same ids, each in its own order (a resend
    # racing its first attempt, batched differently): every id ends up in exactly one row,
    # every batch is answered (the advisory locks are taken in one order), and across all
    # sessions each id was answered 1 exactly once.
    ids = [uuid7() for _ in range(60)]
    start = threading.Barrier(4)
    answered: dict[Any, int] = dict.fromkeys(ids, 0)
    lock = threading.Lock()
    failures: list[BaseException] = []

    def append(seed: int) -> None:
        mine = random.Random(seed)
        try:
            with _connect(pg_dsn) as conn:
                start.wait()
                for _ in range(6):
                    batch = mine.sample(ids, 20)
                    counts = _append(conn, _batch(pg_tenant, batch))
                    with lock:
                        for event_id, inserted in zip(batch, counts, strict=True):
                            answered[event_id] += inserted
        except BaseException as exc:  # reported below
            failures.append(exc)

    workers = [threading.Thread(target=append, args=(n,)) for n in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert failures == []
    with _connect(pg_dsn) as conn:
        rows = _rows(conn, pg_tenant)
    assert len(rows) == len({r[0] for r in rows})
    assert all(count <= 1 for count in answered.values())
    assert {r[0] for r in rows} == {i for i, count in answered.items() if count == 1}
