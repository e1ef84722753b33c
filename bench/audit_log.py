"""What a large audit log costs the gateways, and how fast retention moves it out.

Two databases of their own, both migrated: one whose audit log is filled with ``rows`` rows
spread over monthly partitions (the months before this one, and this month up to now), one
left empty. The fill is one set-based ``INSERT ... SELECT generate_series`` into the log
itself (every index, trigger and partition route as in production), timed. Then a library
heartbeat on each database, interleaved round by round on two connections: the ratio is
heartbeat throughput with the full log over the same with the empty one (each heartbeat
appends one audit row to this month's partition). Then ``mos-lease audit archive`` of the
oldest month: rows/s and MB/s of export, verification and drop together. The rows-per-day
figure is arithmetic: connectors x 86,400 s / heartbeat interval.
"""

from __future__ import annotations

import tempfile
import time
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import attrs
import psycopg
from common import SCOPES, CorrectnessError, throwaway_database
from measure import Case, Series, interleave, throughput_ratio

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease_pg import PostgresLeaseStore
from mos_lease_pg.admin import archive as retention
from tests.pg_support import PgServer

CONNECTORS = 10_000
HEARTBEAT_S = 10
MONTHS_BACK = 6
TTL = 60

# Months before the current one get partitions of their own (as `audit partitions` made
# them in their time); the rows are spread evenly from the first of them up to now.
_PAST_PARTITIONS = """
SELECT {schema}.mos_lease_bench_partition(
           format('{schema}.connector_lease_audit_log_p%%s', to_char(m, 'YYYYMM')), m)
FROM generate_series(date_trunc('month', now() AT TIME ZONE 'UTC')
                     - make_interval(months => %(months)s),
                     date_trunc('month', now() AT TIME ZONE 'UTC') - interval '1 month',
                     interval '1 month') AS m
"""
_MAKE = """
CREATE FUNCTION {schema}.mos_lease_bench_partition(name text, low timestamp) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('CREATE TABLE %s PARTITION OF {schema}.connector_lease_audit_log '
                   'FOR VALUES FROM (%L) TO (%L)', name, low AT TIME ZONE 'UTC',
                   (low + interval '1 month') AT TIME ZONE 'UTC');
    PERFORM {schema}.mos_lease_audit_guard(name::regclass);
END
$$
"""
# The claims the row trigger would have made (migration 0009): the rows minted within a day
# of their month's turn (each id below is minted at its row's stamp).
_CLAIMS = """
INSERT INTO {schema}.connector_lease_event_ids (event_id, seq, recorded_at)
SELECT a.event_id, a.seq, a.recorded_at
FROM {schema}.connector_lease_audit_log AS a,
     LATERAL (SELECT date_trunc('month', a.recorded_at AT TIME ZONE 'UTC') AS m) AS t
WHERE a.recorded_at < (t.m + interval '1 day') AT TIME ZONE 'UTC'
   OR a.recorded_at >= (t.m + interval '1 month' - interval '1 day') AT TIME ZONE 'UTC'
"""
_FILL = """
INSERT INTO {schema}.connector_lease_audit_log
    (event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id,
     connector_id, epoch, correlation_id, recorded_at)
SELECT (left({schema}.mos_lease_event_id_floor(r.at)::text, 14) || '7'
        || substr(gen_random_uuid()::text, 16))::uuid,  -- minted at its stamp, as 0009 takes
       'heartbeat', 'renewed', NULL, 'fill', 'agent-' || (g %% 10000),
       'binding', 'connector-' || (g %% 10000), 1, 'corr-' || g, r.at
FROM (SELECT (date_trunc('month', now() AT TIME ZONE 'UTC')
              - make_interval(months => %(months)s)) AT TIME ZONE 'UTC' AS first,
             now() - ((date_trunc('month', now() AT TIME ZONE 'UTC')
                       - make_interval(months => %(months)s)) AT TIME ZONE 'UTC')
                 - interval '1 second' AS span) AS s,
     generate_series(0, %(rows)s - 1) AS g,
     LATERAL (SELECT s.first + s.span * (g::float8 / %(rows)s) AS at) AS r
"""


@attrs.frozen
class AuditLogResult:
    rows: int
    fill_s: float
    bytes_per_row: float
    partitions: int
    filled: Series
    empty: Series
    ratio: float
    archived_rows: int
    archived_bytes: int
    archive_s: float

    @property
    def rows_per_day(self) -> int:
        return CONNECTORS * 86_400 // HEARTBEAT_S

    @property
    def archive_rows_per_s(self) -> float:
        return self.archived_rows / self.archive_s

    @property
    def archive_mb_per_s(self) -> float:
        return self.archived_bytes / 1e6 / self.archive_s


def _fill(dsn: str, rows: int) -> tuple[float, float, int]:
    schema = '"mos_lease"'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_MAKE.format(schema=schema).encode())
        conn.execute(_PAST_PARTITIONS.format(schema=schema).encode(), {"months": MONTHS_BACK})
        started = time.monotonic()
        with conn.transaction():
            # Past months' rows: no role may stamp those (audit time is the database
            # clock's), so they are planted with the triggers off, and their event-id claims
            # added as the triggers would have (the heartbeats below run beside a full table).
            conn.execute(b"SET LOCAL session_replication_role = replica")
            conn.execute(_FILL.format(schema=schema).encode(),
                         {"rows": rows, "months": MONTHS_BACK})
            conn.execute(_CLAIMS.format(schema=schema).encode())
        fill_s = time.monotonic() - started
        conn.execute(b"VACUUM (ANALYZE) mos_lease.connector_lease_audit_log")
        conn.execute(b"VACUUM (ANALYZE) mos_lease.connector_lease_event_ids")
        # Write the fill's dirty pages out now, not during the timed heartbeats.
        conn.execute(b"CHECKPOINT")
        row = conn.execute(
            b"SELECT sum(pg_total_relation_size(t.relid))"
            b" + pg_total_relation_size('mos_lease.connector_lease_event_ids'),"
            b" count(*) FILTER (WHERE t.level > 0)"
            b" FROM pg_partition_tree('mos_lease.connector_lease_audit_log') AS t").fetchone()
        caught = conn.execute(b"SELECT count(*) FROM ONLY "
                              b"mos_lease.connector_lease_audit_log_default").fetchone()
    assert row is not None and caught is not None
    if caught[0]:
        raise CorrectnessError(f"audit log: {caught[0]} fill rows fell into the DEFAULT")
    return fill_s, float(row[0]) / rows, int(row[1])


def _heartbeat_case(name: str, store: PostgresLeaseStore, tenant: str) -> Case:
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity(tenant, "audit-bench", name)
    taken = gateway.acquire(identity, "c", scopes=SCOPES, ttl=TTL)
    if taken.lease is None:
        raise CorrectnessError(f"audit log: acquire refused: {taken.reason}")
    lease = taken.lease

    def call(_i: int) -> None:
        if not gateway.heartbeat(lease, ttl=TTL).ok:
            raise CorrectnessError("audit log: a heartbeat was refused")

    return Case(name, call)


def _archive_oldest(dsn: str) -> tuple[int, int, float]:
    now = datetime.now(UTC)
    with psycopg.connect(dsn, autocommit=True, options="-c TimeZone=UTC") as conn:
        oldest = retention.partitions(conn, "mos_lease")[0]
    assert oldest.high is not None
    cutoff = oldest.high.date()
    if cutoff > date(now.year, now.month, 1):
        raise CorrectnessError(f"audit log: the oldest partition {oldest.name} is current")
    with tempfile.TemporaryDirectory(prefix="mos-lease-archive-") as out:
        started = time.monotonic()
        report = retention.archive(dsn, "mos_lease", cutoff, Path(out))
        elapsed = time.monotonic() - started
        if [e.partition for e in report.archived] != [oldest.name]:
            raise CorrectnessError(f"audit log: archived {report.archived}, not {oldest.name}")
        if retention.verify(Path(out))[1]:
            raise CorrectnessError("audit log: the archive does not verify")
        digest = report.archived[0].digest
        size = sum(p.stat().st_size for p in Path(out).glob("*.jsonl"))
    return digest.rows, size, elapsed


def run(srv: PgServer, tenant: str, *, rows: int, rounds: int, per_round: int,
        progress: Any) -> AuditLogResult:
    with throwaway_database(srv, "mos_lease_bench_audit_full") as full_dsn, \
            throwaway_database(srv, "mos_lease_bench_audit_empty") as empty_dsn:
        progress(f"audit log: filling {rows:,} rows over {MONTHS_BACK} months and this one")
        fill_s, per_row, parts = _fill(full_dsn, rows)
        progress(f"audit log: filled in {fill_s:.1f} s; heartbeats, full vs empty log")
        with PostgresLeaseStore(full_dsn) as full, PostgresLeaseStore(empty_dsn) as empty:
            series = interleave([_heartbeat_case("full", full, tenant),
                                 _heartbeat_case("empty", empty, tenant)],
                                rounds=rounds, per_round=per_round, warmup=per_round)
        progress("audit log: archiving the oldest month")
        archived, size, archive_s = _archive_oldest(full_dsn)
    return AuditLogResult(rows, fill_s, per_row, parts, series["full"], series["empty"],
                          throughput_ratio(series["full"], series["empty"]), archived, size,
                          archive_s)
