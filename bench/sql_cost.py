"""Where a guarded write's SQL cost goes: today's statements against the statements and schema
of an earlier release, and against today's with one safety piece taken out at a time.

    python bench/sql_cost.py [--rounds N] [--per-round N] [--no-pin] [--cpu N]

Raw heartbeat and takeover compare-and-set statements (no library Python), sent on one
connection, interleaved in rounds, client and backend pinned to one core. The variants:

* ``earlier`` -- the reference floor: the statements and migration 0001 of commit add2cb8
  (before lock-first writes, database-enforced transitions, audit partitions, event-id
  claims and stamp checks), in a schema of their own;
* ``today`` -- the library's statements on today's schema (every migration);
* ``today at version 5`` -- today's statements on the schema before migration 0006 (whose
  guard ran a PL/pgSQL check for every takeover and release);
* ``today -X`` -- today's statements on a copy of today's schema without one trigger X
  (``-fencing`` is the transition guard of 0002/0006, ``-stamps forward`` 0005's,
  ``-claims`` and ``-audit stamp`` 0004's): not safe, shown only to price each piece.

Each ratio is the median over rounds of the per-round rate against ``today``: above 1 means
the piece taken out cost that much.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
from collections.abc import Callable
from typing import Any
from uuid import uuid4

import _path  # the repository's own mos_lease first (and its root, for git)
import psycopg
from common import NO_OFFSET, SCOPES, TTL, CorrectnessError, entry, server, throwaway_database
from measure import Case, Series, interleave, throughput_ratio
from pinning import pin
from psycopg import sql

from mos_lease import LeaseIdentity
from mos_lease.machine import Insert, Renew, Rotate
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import sql_files, statements
from mos_lease_pg.admin import migrate
from mos_lease_pg.admin import migrations as migrations_module

EARLIER = "add2cb8"  # two releases' worth of features ago: see the module docstring
CONNECTOR = "bench-connector"
LEASES = "logical_agent_connector_leases"
LOG = "connector_lease_audit_log"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True,
                          cwd=_path.REPO).stdout


def _earlier_schema(conn: psycopg.Connection[Any], schema: str) -> dict[str, bytes]:
    """Migration 0001 of :data:`EARLIER` in ``schema``; its heartbeat and takeover texts."""
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
    conn.execute(_git("show", f"{EARLIER}:mos_lease_pg/sql/migrations/0001_initial.sql")
                 .encode())
    conn.execute(b"RESET search_path")
    _with_metadata(conn, schema)
    envelope = _git("show", f"{EARLIER}:mos_lease_pg/sql/statements/guarded_write.sql")
    texts = {}
    for name, file in (("renew", "renew.sql"), ("rotate", "rotate.sql")):
        write = _git("show", f"{EARLIER}:mos_lease_pg/sql/statements/{file}")
        text = "\n".join(line for line in envelope.splitlines()
                         if not line.startswith("--")).replace("{write}", write.rstrip())
        for table in (LEASES, LOG):
            text = text.replace(f" {table}", f" {schema}.{table}")
        texts[name] = text.encode()
    return texts


def _at_version(conn: psycopg.Connection[Any], schema: str, version: int) -> None:
    """Today's migrations up to ``version`` only, in ``schema``."""
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    migrations_module._ensure_bookkeeping(conn, schema)
    for migration in migrations_module.available_migrations()[:version]:
        migrations_module._apply(conn, schema, migration, True)
    if version < 7:
        _with_metadata(conn, schema)


def _with_metadata(conn: psycopg.Connection[Any], schema: str) -> None:
    # Today's insert (each side's first lease) names the holder metadata of migration 0007:
    # an older schema gets the column alone, as bench/event_ids.py gives its floor.
    conn.execute(sql.SQL("ALTER TABLE {}.{} ADD COLUMN holder_metadata jsonb NOT NULL "
                         "DEFAULT '{{}}'").format(sql.Identifier(schema), sql.Identifier(LEASES)))


def _copy(dsn: str, conn: psycopg.Connection[Any], schema: str, *drops: tuple[str, str]) -> None:
    """Today's schema in ``schema``, without the triggers ``drops`` names (trigger, table;
    a table of ``LOG`` means the log and each of its partitions)."""
    migrate(dsn, schema=schema, allow_second_copy=True)
    for trigger, table in drops:
        tables = [table]
        if table == LOG:
            tables += [r[0] for r in conn.execute(
                b"SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                b"WHERE i.inhparent = %s::regclass", [f"{schema}.{LOG}"]).fetchall()]
        for name in tables:
            conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}.{}").format(
                sql.Identifier(trigger), sql.Identifier(schema), sql.Identifier(name)))


class _Side:
    """One variant: a schema, the heartbeat and takeover texts to send there."""

    def __init__(self, conn: psycopg.Connection[Any], name: str, schema: str,
                 tenant: str, texts: dict[str, bytes] | None = None) -> None:
        self.conn, self.name, self.schema, self.tenant = conn, name, schema, tenant
        self.texts = texts or {}
        self._ids = itertools.count(1)

    def lease(self) -> tuple[LeaseIdentity, Any]:
        identity = LeaseIdentity(self.tenant, "sqlcost", f"b{next(self._ids)}")
        lease_id = uuid4()
        call = statements.apply(Insert(identity, lease_id, CONNECTOR, tuple(SCOPES), TTL),
                                entry(LifecycleEvent.ACQUIRE, Outcome.ACQUIRED, identity,
                                      CONNECTOR, 1), NO_OFFSET, schema=self.schema)
        if self.schema.endswith("earlier"):
            # The earlier schema has no lock step and no notify: its own acquire is not
            # needed, a plain row of epoch 1 is what its statements expect.
            self.conn.execute(sql.SQL(
                "INSERT INTO {}.{} (tenant_id, logical_agent_id, binding_id, lease_id, "
                "connector_id, allowed_scopes, epoch, acquired_at, heartbeat_at, expires_at, "
                "updated_at) VALUES (%s, %s, %s, %s, %s, %s, 1, now(), now(), "
                "now() + interval '120 s', now())").format(
                    sql.Identifier(self.schema), sql.Identifier(LEASES)),
                [identity.tenant_id, identity.logical_agent_id, identity.binding_id,
                 lease_id, CONNECTOR, list(SCOPES)])
        else:
            self.conn.execute(call.statement.text, call.params)
        return identity, lease_id

    def text(self, kind: str, call_text: bytes) -> bytes:
        return self.texts.get(kind, call_text)

    def heartbeat(self) -> Case:
        identity, lease_id = self.lease()
        renew = Renew(identity, CONNECTOR, lease_id, 1, TTL)
        prepared: list[tuple[bytes, Any]] = []

        def setup(n: int) -> None:
            prepared[:] = []
            for _ in range(n):
                call = statements.apply(renew, entry(LifecycleEvent.HEARTBEAT,
                                                     Outcome.RENEWED, identity, CONNECTOR, 1),
                                        NO_OFFSET, schema=self.schema)
                prepared.append((self.text("renew", call.statement.text), call.params))

        def call(i: int) -> None:
            text, params = prepared[i]
            row = self.conn.execute(text, params, prepare=True).fetchone()
            if row is None or row[1] is None:
                raise CorrectnessError(f"sql cost: {self.name} heartbeat refused")

        return Case(self.name, call, setup=setup)

    def takeover(self) -> Case:
        identity, _ = self.lease()
        epoch = [1]
        prepared: list[tuple[bytes, Any]] = []

        def setup(n: int) -> None:
            prepared[:] = []
            for k in range(n):
                rotate = Rotate(identity, epoch[0] + k, True, uuid4(), CONNECTOR,
                                tuple(SCOPES), TTL)
                call = statements.apply(rotate, entry(LifecycleEvent.TAKEOVER,
                                                      Outcome.TAKEN_OVER, identity, CONNECTOR,
                                                      epoch[0] + k + 1),
                                        NO_OFFSET, schema=self.schema)
                prepared.append((self.text("rotate", call.statement.text), call.params))
            epoch[0] += n

        def call(i: int) -> None:
            text, params = prepared[i]
            row = self.conn.execute(text, params, prepare=True).fetchone()
            if row is None or row[1] is None:
                raise CorrectnessError(f"sql cost: {self.name} takeover refused")

        return Case(self.name, call, setup=setup)




# (0009's event-id claim is a trigger of each partition, with a WHEN that passes no row
# minted mid-month, and its unique index is also the lookup by event id: neither is priced
# here; bench/event_id_designs.py compares it with 0004's claim of every row.)
VARIANTS: list[tuple[str, tuple[tuple[str, str], ...]]] = [
    ("-audit stamp", (("connector_lease_audit_log_stamp", LOG),)),
    ("-stamps forward", (("logical_agent_connector_leases_stamps_forward", LEASES),)),
    ("-fencing", (("logical_agent_connector_leases_fencing", LEASES),)),
]


def run(dsn: str, conn: psycopg.Connection[Any], tenant: str, *, rounds: int, per_round: int,
        progress: Callable[[str], None]) -> dict[str, dict[str, Series]]:
    progress("sql cost: schemas")
    migrate(dsn)
    sides = [_Side(conn, "today", sql_files.DEFAULT_SCHEMA, tenant),
             _Side(conn, "earlier", "sqlcost_earlier", tenant,
                   _earlier_schema(conn, "sqlcost_earlier"))]
    _at_version(conn, "sqlcost_v5", 5)
    sides.append(_Side(conn, "today at version 5", "sqlcost_v5", tenant))
    for k, (name, drops) in enumerate(VARIANTS):
        schema = f"sqlcost_v{k}"
        _copy(dsn, conn, schema, *drops)
        sides.append(_Side(conn, f"today {name}", schema, tenant))
    out = {}
    for kind in ("heartbeat", "takeover"):
        progress(f"sql cost: {kind}")
        cases = [getattr(side, kind)() for side in sides]
        out[kind] = interleave(cases, rounds=rounds, per_round=per_round,
                               warmup=min(50, per_round))
    return out


def check_function_time(conn: psycopg.Connection[Any], *, n: int) -> list[str]:
    """Server time of the transition guard's PL/pgSQL check per takeover, before 0006 (the
    schema at version 5) and now, from PostgreSQL's own function statistics
    (``track_functions``, superuser only): a figure the shared machine's scheduling does not
    blur, since it is the function's own time. ``n`` takeovers of one row, in one
    transaction per schema."""
    lines = []
    for k, (label, schema) in enumerate((("version 5", "sqlcost_v5"),
                                         ("today", sql_files.DEFAULT_SCHEMA)) * 2):
        case = _Side(conn, label, schema, f"sqlcost-fn{k}").takeover()
        case.setup(n)
        check = f"{schema}.mos_lease_check_lease_write"
        with conn.transaction():
            conn.execute(b"SET LOCAL track_functions = 'pl'")
            for i in range(n):
                case.call(i)
            row = conn.execute(sql.SQL(
                "SELECT coalesce(pg_stat_get_xact_function_calls({f}::regproc), 0), "
                "coalesce(pg_stat_get_xact_function_total_time({f}::regproc), 0)").format(
                    f=sql.Literal(check))).fetchone()
        calls, total_ms = row if row is not None else (0, 0.0)
        lines.append(f"  {label:<10} check calls {calls:>5} for {n} takeovers, "
                     f"{1000 * float(total_ms) / n:6.1f} µs of check per takeover")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/sql_cost.py")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=200)
    parser.add_argument("--cpu", type=int, default=None)
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--flush", action="store_true",
                        help="keep the commit flush (by default this session sets "
                        "synchronous_commit = off: the flush, milliseconds on a shared disk, "
                        "would hide the microseconds the statements' own work costs)")
    args = parser.parse_args(argv)
    srv = server()
    try:
        with throwaway_database(srv, "mos_lease_bench_sqlcost", migrated=False) as dsn, \
                psycopg.connect(dsn, autocommit=True) as conn:
            if not args.flush:
                conn.execute(b"SET synchronous_commit = off")
            pinning = pin(conn, cpu=args.cpu, enabled=not args.no_pin)
            print(pinning.note, file=sys.stderr)
            try:
                found = run(dsn, conn, "sqlcost", rounds=args.rounds,
                            per_round=args.per_round,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
                checked = check_function_time(conn, n=args.per_round * 5)
            finally:
                pinning.restore()
    finally:
        srv.stop()
    for kind, series in found.items():
        today = series["today"]
        print(f"\n{kind} (raw statement, {args.rounds} rounds of {args.per_round}, "
              f"{'with' if args.flush else 'without'} the commit flush)")
        for name, s in series.items():
            print(f"  {name:<24} {s.ops_per_s:>9,.0f}/s  p50 {s.p50_us:7.1f} µs  "
                  f"{throughput_ratio(s, today):.3f}x today")
    print("\nthe transition guard's PL/pgSQL check (function statistics), takeovers:")
    print("\n".join(checked))
    return 0


if __name__ == "__main__":
    sys.exit(main())
