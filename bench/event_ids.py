"""What the audit log's integrity costs per write: event ids held unique (migration 0009: a
unique index per partition where version 3 had a plain one, a CHECK of uuid constants, a
claim only for ids minted within a day of a month's turn) and the stamp check (0004, a WHEN
expression).

One database, two schemas side by side: ``v3`` migrated through version 3 only (the
reference floor: the same heartbeat statement, no claim, no stamp check; it gets the holder
metadata column of migration 0007, which today's statement names, and nothing else of
versions 4 to 8) and ``v4`` fully migrated. The raw heartbeat statement the store sends
(``mos_lease_pg.statements``, one lease per schema) runs on one connection, interleaved round
by round, pinned with the others; a batched heartbeat (``heartbeat_many`` of 100 leases)
likewise. A second pass runs with ``synchronous_commit = off`` for this session, where no
commit flush hides the CPU the claim adds. ``bench/run.py`` runs it with the other
single-connection comparisons; alone:

    python bench/event_ids.py [--rounds N] [--per-round N]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import attrs
import psycopg
from common import TTL, CorrectnessError, entry, server, throwaway_database, written
from measure import Case, Series, interleave, throughput_ratio
from pinning import pin

from mos_lease import LeaseIdentity
from mos_lease.ids import uuid7
from mos_lease.machine import Insert, Renew
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import statements
from mos_lease_pg.admin import migrate
from mos_lease_pg.admin import migrations as migrations_module

OLD = "bench_v3"
NEW = "bench_v4"
BATCH = 100
NO_OFFSET = timedelta(0)


@attrs.frozen
class EventIdResult:
    single: dict[str, Series]  # "v3", "v4"
    batch: dict[str, Series]
    no_flush: dict[str, Series]

    @property
    def heartbeat_ratio(self) -> float:
        return throughput_ratio(self.single[NEW], self.single[OLD])

    @property
    def batch_ratio(self) -> float:
        return throughput_ratio(self.batch[NEW], self.batch[OLD])

    @property
    def no_flush_ratio(self) -> float:
        return throughput_ratio(self.no_flush[NEW], self.no_flush[OLD])


def _schemas(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in (OLD, NEW):
            conn.execute(f"CREATE SCHEMA {schema}".encode())
        migrations_module._ensure_bookkeeping(conn, OLD)
        for migration in migrations_module.available_migrations()[:3]:
            migrations_module._apply(conn, OLD, migration, True)
        # Today's statement writes the holder metadata (migration 0007): the floor gets the
        # column alone, none of the checks that came with it or after version 3.
        conn.execute(f"ALTER TABLE {OLD}.logical_agent_connector_leases ADD COLUMN "
                     "holder_metadata jsonb NOT NULL DEFAULT '{}'".encode())
    migrate(dsn, schema=NEW, allow_second_copy=True)


def _same(text: bytes) -> bytes:
    return text


# ``rewrite`` turns the library's statement text into a variant's (event_id_designs.py
# measures other ways to claim an event id with the same cases).
Rewrite = Callable[[bytes], bytes]
# Where a variant's event ids come from (a design may need ids of its own kind).
Mint = Callable[[], UUID]


def _leases(conn: psycopg.Connection[Any], schema: str, tenant: str,
            n: int, rewrite: Rewrite = _same, mint: Mint = uuid7) -> list[Renew]:
    renewals = []
    for k in range(n):
        identity = LeaseIdentity(tenant, "agent", f"b{k}")
        insert = Insert(identity, uuid4(), "bench", ("tool:run",), TTL)
        call = statements.apply(insert, entry(LifecycleEvent.ACQUIRE, Outcome.ACQUIRED,
                                              identity, "bench", 1, mint()),
                                NO_OFFSET, schema=schema)
        if not written(conn.execute(rewrite(call.statement.text), call.params).fetchall()[0]):
            raise CorrectnessError(f"bench lease {identity} was not acquired in {schema}")
        renewals.append(Renew(identity, "bench", insert.lease_id, 1, TTL))
    return renewals


def _heartbeat(conn: psycopg.Connection[Any], schema: str, renew: Renew,
               rewrite: Rewrite = _same, mint: Mint = uuid7) -> Case:
    prepared: list[tuple[bytes, dict[str, Any]]] = []

    def setup(n: int) -> None:
        prepared[:] = []
        for _ in range(n):
            call = statements.apply(renew, entry(LifecycleEvent.HEARTBEAT, Outcome.RENEWED,
                                                 renew.identity, "bench", 1, mint()),
                                    NO_OFFSET, schema=schema)
            prepared.append((rewrite(call.statement.text), dict(call.params)))

    def call(i: int) -> None:
        text, params = prepared[i]
        if not written(conn.execute(text, params, prepare=True).fetchall()[0]):
            raise CorrectnessError(f"heartbeat refused in {schema}")

    return Case(schema, call, setup=setup)


def _batch(conn: psycopg.Connection[Any], schema: str, renewals: list[Renew],
           rewrite: Rewrite = _same, mint: Mint = uuid7) -> Case:
    prepared: list[tuple[bytes, dict[str, Any]]] = []

    def setup(n: int) -> None:
        prepared[:] = []
        for _ in range(n):
            call = statements.renew_many(
                [(r, entry(LifecycleEvent.HEARTBEAT, Outcome.RENEWED, r.identity, "bench", 1,
                           mint()))
                 for r in renewals], NO_OFFSET, schema=schema, audit_heartbeats=True)
            prepared.append((rewrite(call.statement.text), dict(call.params)))

    def call(i: int) -> None:
        text, params = prepared[i]
        rows = conn.execute(text, params, prepare=True).fetchall()
        if not all(written(row) for row in rows):
            raise CorrectnessError(f"a batched heartbeat was refused in {schema}")

    return Case(schema, call, setup=setup, ops_per_call=len(renewals))


def run(dsn: str, tenant: str, *, rounds: int, per_round: int, batch_calls: int,
        warmup: int, cpu: int | None, pinned: bool,
        progress: Callable[[str], None]) -> EventIdResult:
    progress("event ids: heartbeat of today's schema (ids by time, 0009; stamp checks, 0004) "
             "against version 3, side by side")
    _schemas(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        pinning = pin(conn, cpu=cpu, enabled=pinned)
        try:
            single = {schema: _leases(conn, schema, tenant, 1)[0] for schema in (OLD, NEW)}
            many = {schema: _leases(conn, schema, f"{tenant}-many", BATCH)
                    for schema in (OLD, NEW)}
            cases = [_heartbeat(conn, schema, single[schema]) for schema in (OLD, NEW)]
            measured = interleave(cases, rounds=rounds, per_round=per_round, warmup=warmup)
            batches = interleave([_batch(conn, schema, many[schema]) for schema in (OLD, NEW)],
                                 rounds=rounds, per_round=batch_calls, warmup=1)
            conn.execute(b"SET synchronous_commit = off")
            no_flush = interleave(cases, rounds=rounds, per_round=per_round, warmup=warmup)
        finally:
            pinning.restore()
    return EventIdResult(measured, batches, no_flush)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/event_ids.py", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--per-round", type=int, default=150)
    parser.add_argument("--cpu", type=int, default=None)
    parser.add_argument("--no-pin", action="store_true")
    args = parser.parse_args(argv)
    srv = server()
    try:
        with throwaway_database(srv, "mos_lease_bench_event_ids", migrated=False) as dsn:
            result = run(dsn, "bench", rounds=args.rounds, per_round=args.per_round,
                         batch_calls=4, warmup=100, cpu=args.cpu, pinned=not args.no_pin,
                         progress=lambda m: print(m, file=sys.stderr))
    finally:
        srv.stop()
    for label, series, ratio in (("heartbeat", result.single, result.heartbeat_ratio),
                                 (f"heartbeat_many({BATCH})", result.batch, result.batch_ratio),
                                 ("heartbeat, no flush", result.no_flush,
                                  result.no_flush_ratio)):
        print(f"{label:<22} today {series[NEW].ops_per_s:>10,.0f}/s  schema 3 "
              f"{series[OLD].ops_per_s:>10,.0f}/s  ratio {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
