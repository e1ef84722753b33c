"""What the stamp checks cost per write: heartbeats with and without them, side by side.

A write on an existing row is refused when the database clock reads earlier than the row's
latest stamp (``clock_behind``): the guard ``l.updated_at <= t.now`` in the statement
(``active_holder.sql``, ``rotate.sql``) and, for every other writer, the trigger of
migration 0005. The floor is the heartbeat as it was before both: the same statement with
that guard line taken out, on a second copy of the schema in the benchmark's database whose
trigger was dropped. The line is taken out of the library's own statement text (not a copy),
and a statement that no longer has it fails the benchmark, so the floor cannot drift.

Three cases on the store's own connection, sent the way the store sends them (its wire),
interleaved: now (guard + trigger), the guard alone (second schema, no trigger), and before
(second schema, neither). Single heartbeats and batches of 100 (``renew_many.sql``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any
from uuid import uuid4

import attrs
import psycopg
from common import (
    NO_OFFSET,
    SCOPES,
    TTL,
    CorrectnessError,
    Raw,
    entry,
    run_wire,
    store_wire,
    written,
)
from measure import Case, Series, interleave
from psycopg import sql

from mos_lease import LeaseIdentity
from mos_lease.machine import Insert, Renew
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import PostgresLeaseStore, statements
from mos_lease_pg.admin import migrate
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, Template

GUARD_LINE = "      AND l.updated_at <= t.now\n"
TRIGGER = "logical_agent_connector_leases_stamps_forward"
BEFORE_SCHEMA = "mos_lease_bench_before_stamps"
CONNECTOR = "bench-connector"
BATCH = 100


def _without_guard(template: Template) -> Template:
    """``template`` as it was before the stamp check: its guard line taken out."""
    if GUARD_LINE.strip() not in template.text:
        raise CorrectnessError(f"{template.name} has no stamp guard to take out")
    text = "\n".join(line for line in template.text.splitlines()
                     if line.strip() != GUARD_LINE.strip())
    return Template(f"{template.name} (before stamp checks)", text)


@attrs.frozen
class StampResult:
    """Each comparison with the commit flush (as in production) and without it (this session
    only: ``synchronous_commit = off``), which leaves the CPU cost the checks add."""

    single: dict[str, Series]
    batch: dict[str, Series]
    single_no_flush: dict[str, Series]
    batch_no_flush: dict[str, Series]


class _Leases:
    """Leases acquired in one schema, and the heartbeat statements of one variant."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str, tenant: str) -> None:
        self.conn, self.schema, self.tenant = conn, schema, tenant
        self._ids = itertools.count(1)

    def acquire(self, n: int) -> list[Renew]:
        renews = []
        for _ in range(n):
            identity = LeaseIdentity(self.tenant, "stamps", f"b{next(self._ids)}")
            lease_id = uuid4()
            write = Insert(identity, lease_id, CONNECTOR, tuple(SCOPES), TTL)
            call = statements.apply(write, entry(LifecycleEvent.ACQUIRE, Outcome.ACQUIRED,
                                                 identity, CONNECTOR, 1),
                                    NO_OFFSET, schema=self.schema)
            row = self.conn.execute(call.statement.text, call.params).fetchone()
            if row is None or not written(row):
                raise CorrectnessError(f"stamps: setup acquire refused in {self.schema}")
            renews.append(Renew(identity, CONNECTOR, lease_id, 1, TTL))
        return renews


def _single(wire: Any, leases: _Leases, template: Template, name: str) -> Case:
    [renew] = leases.acquire(1)
    statement = template.at(leases.schema)
    prepared: list[Raw] = []

    def setup(n: int) -> None:
        params = [statements.apply(renew, entry(LifecycleEvent.HEARTBEAT, Outcome.RENEWED,
                                                renew.identity, CONNECTOR, 1), NO_OFFSET,
                                   schema=leases.schema).params for _ in range(n)]
        prepared[:] = [Raw(statement, p) for p in params]

    def call(i: int) -> None:
        if not written(run_wire(wire, prepared[i])):
            raise CorrectnessError(f"stamps: {name} heartbeat refused")

    return Case(name, call, setup=setup)


def _batch(wire: Any, leases: _Leases, template: Template, name: str,
           calls: int) -> Case:
    renews = leases.acquire(BATCH)
    statement = template.at(leases.schema)
    prepared: list[Raw] = []

    def setup(n: int) -> None:
        prepared[:] = [Raw(statement, statements.renew_many(
            [(r, entry(LifecycleEvent.HEARTBEAT, Outcome.RENEWED, r.identity, CONNECTOR, 1))
             for r in renews], NO_OFFSET, schema=leases.schema).params) for _ in range(n)]

    def call(i: int) -> None:
        rows = wire.execute(prepared[i].statement.text, prepared[i].params)
        if len(rows) != BATCH or not all(written(row) for row in rows):
            raise CorrectnessError(f"stamps: {name} batch not fully renewed")

    return Case(name, call, setup=setup, ops_per_call=BATCH, per_round=calls)


def _before_schema(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A second copy of the schema, as it was before the stamp checks (no trigger)."""
    migrate(dsn, schema=BEFORE_SCHEMA, allow_second_copy=True)
    conn.execute(sql.SQL("DROP TRIGGER {} ON {}.logical_agent_connector_leases").format(
        sql.Identifier(TRIGGER), sql.Identifier(BEFORE_SCHEMA)))


def run(dsn: str, store: PostgresLeaseStore, conn: psycopg.Connection[Any], tenant: str, *,
        rounds: int, per_round: int, batch_calls: int, warmup: int,
        progress: Callable[[str], None]) -> StampResult:
    progress("stamp checks: heartbeats with and without them (same connection)")
    _before_schema(dsn, conn)
    wire = store_wire(store)
    now = _Leases(conn, DEFAULT_SCHEMA, tenant)
    before = _Leases(conn, BEFORE_SCHEMA, tenant)
    renew = statements.WRITES[Renew]
    old_renew = _without_guard(renew)
    old_renew_many = _without_guard(statements.RENEW_MANY)

    def compare() -> tuple[dict[str, Series], dict[str, Series]]:
        single = interleave([
            _single(wire, now, renew, "now"),
            _single(wire, before, renew, "guard only"),
            _single(wire, before, old_renew, "before"),
        ], rounds=rounds, per_round=per_round, warmup=warmup)
        batch = interleave([
            _batch(wire, now, statements.RENEW_MANY, "now", batch_calls),
            _batch(wire, before, old_renew_many, "before", batch_calls),
        ], rounds=rounds, per_round=per_round, warmup=min(warmup, batch_calls))
        return single, batch

    single, batch = compare()
    progress("stamp checks: the same without the commit flush (this session)")
    conn.execute(b"SET synchronous_commit = off")
    try:
        single_no_flush, batch_no_flush = compare()
    finally:
        conn.execute(b"RESET synchronous_commit")
    return StampResult(single, batch, single_no_flush, batch_no_flush)
