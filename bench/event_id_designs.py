"""Other ways to hold an event id to one audit row, measured against migration 0004's.

Migration 0004 claimed every audit row's event id from an AFTER INSERT statement trigger (a
transition table) on the log and every partition; migration 0009 replaced that claim. This
compares, on one connection, interleaved round by round, with the cases of ``event_ids.py``
(heartbeat, a batched heartbeat of 100, and heartbeat without a commit flush), these schemas
side by side:

* ``v3``: migrated through version 3 only (the floor ``event_ids.py`` measures against);
* ``v8``: migrated through version 8 (0004's statement trigger); every variant below but
  ``v4`` starts from it;
* ``v4``: fully migrated (named so for history): today's design, 0009's ids placed by their
  minting time (a unique index per partition, a CHECK of uuid constants, a claim only
  within a day of a month's turn);
* ``fk``: version 8, the trigger dropped; instead the log (and so every partition)
  has a FOREIGN KEY (event_id, seq, recorded_at) to the claims, which are UNIQUE on those
  three columns as well as keyed by event id; the statement inserts the claim itself, from
  the audit row's RETURNING, in a sibling data-modifying CTE (the key is checked at the
  end of the statement, so the order of the two inserts does not matter). The key must
  name recorded_at as well as seq: seq alone is not unique across partitions, and any role
  that may insert may name it (OVERRIDING SYSTEM VALUE), so a second row could reuse the
  first row's claim;
* ``floor``: as ``fk`` but with no foreign key: the claim the library writes, with nothing
  making other paths claim (what any guard costs on top of the claim itself);
* ``row``: version 8, the statement trigger replaced by an AFTER INSERT trigger FOR
  EACH ROW on the log (cloned to every partition by PostgreSQL), which claims ``NEW``'s id:
  no transition table is kept, but one trigger event is queued per row;
* ``before``: as ``row``, but BEFORE INSERT: the claim is made as the row is formed (its
  ``seq`` default is already drawn then), with no after-trigger event queued at all. A row
  the log then refuses fails its statement, and the claim rolls back with it;
* ``local``: no claims table at all. Event ids are time-ordered (UUID version 7, the
  millisecond of minting in the first 48 bits); each partition has a UNIQUE index on
  event_id (where version 3 had a plain one on the log), and a BEFORE INSERT row trigger
  whose WHEN clause admits, without calling anything, a row whose id was minted within an
  hour of the statement's time and whose hour window lies inside one month. Two rows with
  one id then lie within two hours of each other, so in one partition, where the unique
  index refuses the second, except in the two hours around a month boundary, where the
  trigger's function would run (here it only refuses: the benchmark runs mid-month). This
  prices the design; the library does not use it.

    python bench/event_id_designs.py [--rounds N] [--per-round N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import Any

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import event_ids
import psycopg
from common import NO_OFFSET, CorrectnessError, entry, server, throwaway_database
from measure import Series, interleave, throughput_ratio
from pinning import pin

from mos_lease.machine import Renew
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import statements
from mos_lease_pg.admin import migrations as migrations_module

FK = "bench_fk"
FLOOR = "bench_floor"
ROW = "bench_row"
BEFORE = "bench_before"
LOCAL = "bench_local"
# Where the audit CTE ends in guarded_write.sql and in renew_many.sql.
_AFTER_AUDIT = (b"\n),\nnotified AS MATERIALIZED", b"\n)\nSELECT t.now")
_CLAIM = (b"\n    RETURNING event_id, seq, recorded_at\n),\nclaimed AS (\n"
          b"    INSERT INTO %s.connector_lease_event_ids (event_id, seq, recorded_at)\n"
          b"    SELECT a.event_id, a.seq, a.recorded_at FROM audited AS a")


def _claiming(schema: str) -> event_ids.Rewrite:
    def rewrite(text: bytes) -> bytes:
        for end in _AFTER_AUDIT:
            if text.count(end) == 1 and b"INSERT INTO" in text:
                return text.replace(end, _CLAIM % schema.encode() + end)
        return text
    return rewrite


def _through_8(dsn: str, schema: str) -> None:
    """Migrate ``schema`` through version 8: 0004's claim of every row, before 0009."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}".encode())
        migrations_module._ensure_bookkeeping(conn, schema)
        for migration in migrations_module.available_migrations()[:8]:
            migrations_module._apply(conn, schema, migration, True)


def _variant(dsn: str, schema: str, *, foreign_key: bool = False,
             row_trigger: str | None = None) -> None:
    _through_8(dsn, schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        log = f"{schema}.connector_lease_audit_log"
        parts = [row[0] for row in conn.execute(
            b"SELECT i.inhrelid::regclass::text FROM pg_inherits AS i "
            b"WHERE i.inhparent = %s::regclass", (log,)).fetchall()]
        for table in [log, *parts]:
            conn.execute(f"DROP TRIGGER connector_lease_audit_log_event_once ON {table}"
                         .encode())
        if row_trigger is not None:
            conn.execute(f"""
                CREATE FUNCTION {schema}.bench_claim_row() RETURNS trigger
                LANGUAGE plpgsql SECURITY DEFINER AS $body$
                BEGIN
                    INSERT INTO {schema}.connector_lease_event_ids (event_id, seq, recorded_at)
                    VALUES (NEW.event_id, NEW.seq, NEW.recorded_at);
                    RETURN NEW;
                END
                $body$""".encode())
            conn.execute(f"CREATE TRIGGER connector_lease_audit_log_event_once {row_trigger} "
                         f"INSERT ON {log} FOR EACH ROW EXECUTE FUNCTION "
                         f"{schema}.bench_claim_row()".encode())
        if foreign_key:
            conn.execute(f"ALTER TABLE {schema}.connector_lease_event_ids ADD UNIQUE "
                         f"(event_id, seq, recorded_at)".encode())
            conn.execute(f"ALTER TABLE {log} ADD FOREIGN KEY (event_id, seq, recorded_at) "
                         f"REFERENCES {schema}.connector_lease_event_ids "
                         f"(event_id, seq, recorded_at)".encode())


def uuid7() -> uuid.UUID:
    """A time-ordered event id: the wall clock's millisecond, then version 7 and random bits."""
    raw = bytearray((time.time_ns() // 1_000_000).to_bytes(6, "big") + os.urandom(10))
    raw[6] = 0x70 | (raw[6] & 0x0F)
    raw[8] = 0x80 | (raw[8] & 0x3F)
    return uuid.UUID(bytes=bytes(raw))


# The millisecond a version-7 id was minted at, read from its text (no function to call).
_MINTED_MS = ("('x' || substr(NEW.event_id::text, 1, 8) || substr(NEW.event_id::text, 10, 4))"
              "::bit(48)::bigint")
_WINDOW_MS = 3_600_000
_LOCAL_WHEN = (f"abs({_MINTED_MS} - (extract(epoch FROM statement_timestamp()) * 1000)::bigint)"
               f" > {_WINDOW_MS} OR date_trunc('month', statement_timestamp() - interval "
               f"'1 hour') <> date_trunc('month', statement_timestamp() + interval '1 hour')")


def _local(dsn: str, schema: str) -> None:
    """The ``local`` design: no claims; a unique index per partition and a guarded window."""
    _variant(dsn, schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        log = f"{schema}.connector_lease_audit_log"
        for (part,) in conn.execute(b"SELECT i.inhrelid::regclass::text FROM pg_inherits AS i "
                                    b"WHERE i.inhparent = %s::regclass", (log,)).fetchall():
            conn.execute(f"CREATE UNIQUE INDEX ON {part} (event_id)".encode())
        conn.execute(f"""
            CREATE FUNCTION {schema}.bench_event_window() RETURNS trigger
            LANGUAGE plpgsql AS $body$
            BEGIN
                RAISE EXCEPTION 'event id % outside its window or near a month boundary',
                    NEW.event_id;
            END
            $body$""".encode())
        conn.execute(f"CREATE TRIGGER bench_event_window BEFORE INSERT ON {log} FOR EACH ROW "
                     f"WHEN ({_LOCAL_WHEN}) EXECUTE FUNCTION {schema}.bench_event_window()"
                     .encode())


V8 = "bench_v8"


def run(dsn: str, *, rounds: int, per_round: int) -> dict[str, dict[str, Series]]:
    event_ids._schemas(dsn)
    _through_8(dsn, V8)
    _variant(dsn, FK, foreign_key=True)
    _variant(dsn, FLOOR)
    _variant(dsn, ROW, row_trigger="AFTER")
    _variant(dsn, BEFORE, row_trigger="BEFORE")
    _local(dsn, LOCAL)
    rewrites = {event_ids.OLD: event_ids._same, V8: event_ids._same,
                event_ids.NEW: event_ids._same,
                FK: _claiming(FK), FLOOR: _claiming(FLOOR), ROW: event_ids._same,
                BEFORE: event_ids._same, LOCAL: event_ids._same}
    mints = {LOCAL: uuid7, event_ids.NEW: uuid7}
    with psycopg.connect(dsn, autocommit=True) as conn:
        pinning = pin(conn, cpu=None, enabled=True)
        try:
            single = {s: event_ids._leases(conn, s, "bench", 1, r, mints.get(s, uuid.uuid4))[0]
                      for s, r in rewrites.items()}
            cases = [event_ids._heartbeat(conn, s, single[s], r, mints.get(s, uuid.uuid4))
                     for s, r in rewrites.items()]
            measured = {"heartbeat": interleave(cases, rounds=rounds, per_round=per_round,
                                                warmup=100)}
            # Acquired only now: on a loaded machine the heartbeats above may outlast a TTL.
            many = {s: event_ids._leases(conn, s, "bench-many", event_ids.BATCH, r,
                                         mints.get(s, uuid.uuid4))
                    for s, r in rewrites.items()}
            measured[f"heartbeat_many({event_ids.BATCH})"] = interleave(
                [event_ids._batch(conn, s, many[s], r, mints.get(s, uuid.uuid4))
                 for s, r in rewrites.items()],
                rounds=rounds, per_round=4, warmup=1)
            conn.execute(b"SET synchronous_commit = off")
            measured["heartbeat, no flush"] = interleave(cases, rounds=rounds,
                                                         per_round=per_round, warmup=100)
        finally:
            pinning.restore()
        _check_claimed(conn)
        _check_local(conn, single[LOCAL])
    return measured


def _check_local(conn: psycopg.Connection[Any], renew: Renew) -> None:
    # The local design really refuses an id applied twice (else the comparison is void).
    event_id = uuid7()
    for attempt in (1, 2):
        call = statements.apply(renew, entry(LifecycleEvent.HEARTBEAT, Outcome.RENEWED,
                                             renew.identity, "bench", 1, event_id),
                                NO_OFFSET, schema=LOCAL)
        try:
            conn.execute(call.statement.text, call.params)
        except psycopg.errors.UniqueViolation:
            if attempt == 2:
                return
            raise
    raise CorrectnessError(f"{LOCAL}: one event id was applied twice")


def _check_claimed(conn: psycopg.Connection[Any]) -> None:
    # Every audit row of the variants was really claimed (else the comparison is void).
    for schema in (FK, FLOOR, ROW, BEFORE):
        rows, claims = conn.execute(
            f"SELECT (SELECT count(*) FROM {schema}.connector_lease_audit_log), "
            f"(SELECT count(*) FROM {schema}.connector_lease_event_ids)".encode()).fetchone() \
            or (0, -1)
        if rows != claims:
            raise CorrectnessError(f"{schema}: {rows} audit rows, {claims} claims")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/event_id_designs.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--per-round", type=int, default=150)
    args = parser.parse_args(argv)
    srv = server()
    try:
        with throwaway_database(srv, "mos_lease_bench_event_id_designs",
                                migrated=False) as dsn:
            measured = run(dsn, rounds=args.rounds, per_round=args.per_round)
    finally:
        srv.stop()
    names = {V8: "trigger (0004)", event_ids.NEW: "by time (0009)", FK: "foreign key",
             FLOOR: "no guard", ROW: "row trigger", BEFORE: "before-row trigger", LOCAL: "local"}
    for label, series in measured.items():
        old = series[event_ids.OLD]
        print(f"{label:<22} schema 3 {old.ops_per_s:>9,.0f}/s  " + "  ".join(
            f"{name} {throughput_ratio(series[s], old):.3f}" for s, name in names.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
