"""The partitioned audit log (migration 0003): a populated log of version 2 converts with
every row and seq kept; every partition, present or made later, refuses UPDATE, DELETE and
TRUNCATE, for every role; the gateway role cannot reach a partition at all; rows the
DEFAULT partition caught are adopted whole; a resent record is logged once even when its
copies race."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.ids import uuid7
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore, preflight
from mos_lease_pg.admin import archive as retention
from mos_lease_pg.admin import migrate
from mos_lease_pg.admin import migrations as migrations_module
from tests.pg.test_pg_roles import Layout, role_layout
from tests.pg_fixtures import PgSchema, StoreFactory, allow_test_clock

pytestmark = pytest.mark.pg

AUDIT = "connector_lease_audit_log"
COLUMNS = ("seq, event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id,"
           " connector_id, epoch, correlation_id, recorded_at")


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, options="-c TimeZone=UTC")


def _partitions(dsn: str, schema: str) -> list[str]:
    with _connect(dsn) as conn:
        return [p.name for p in retention.partitions(conn, schema)]


def _rows(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    with _connect(dsn) as conn:
        return conn.execute(sql.SQL("SELECT " + COLUMNS + " FROM {}.{} ORDER BY seq").format(
            sql.Identifier(schema), sql.Identifier(AUDIT))).fetchall()


def minted_at(at: str) -> str:
    """SQL for a fresh time-ordered (version 7) event id minted at the time ``at`` names, as
    the log takes them (migration 0009): its millisecond, the version digit, random bits."""
    ms = f"lpad(to_hex(floor(extract(epoch FROM {at}) * 1000)::bigint), 12, '0')"
    return (f"(left({ms}, 8) || '-' || substr({ms}, 9, 4) || '-7' || "
            "substr(gen_random_uuid()::text, 16))::uuid")


def _insert_old_rows(conn: psycopg.Connection[Any], schema: str, months_ago: int,
                     count: int, tenant: str = "old") -> None:
    """Rows stamped in a past month. No role may append those (audit time is the database
    clock's, migration 0004): a superuser plants them with the schema's triggers off."""
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        _insert_rows(conn, schema, months_ago, count, tenant)


def _insert_rows(conn: psycopg.Connection[Any], schema: str, months_ago: int,
                 count: int, tenant: str) -> None:
    conn.execute(sql.SQL(
        "INSERT INTO {}.{} (event_id, event, outcome, reason, tenant_id, logical_agent_id,"
        " binding_id, connector_id, epoch, correlation_id, recorded_at)"
        " SELECT " + minted_at("t.at") + ", 'heartbeat', 'renewed', NULL, %s, 'a', 'b', 'c',"
        " 1, 'corr-' || g, t.at"
        " FROM generate_series(1, %s) AS g, LATERAL (SELECT date_trunc('month', now() AT TIME"
        " ZONE 'UTC') AT TIME ZONE 'UTC' - make_interval(months => %s)"
        " + make_interval(mins => g) AS at) AS t").format(sql.Identifier(schema),
                                                          sql.Identifier(AUDIT)),
        (tenant, count, months_ago))


@pytest.fixture
def version_2(pg_schema_dsn: PgSchema) -> Iterator[PgSchema]:
    """A schema migrated to version 2 only: a database of the field before 0003."""
    with _connect(pg_schema_dsn.dsn) as conn:
        migrations_module._ensure_bookkeeping(conn, pg_schema_dsn.schema)
        for migration in migrations_module.available_migrations()[:2]:
            migrations_module._apply(conn, pg_schema_dsn.schema, migration, True)
    yield pg_schema_dsn


def test_a_populated_version_2_log_converts_keeping_every_row_and_seq(
        version_2: PgSchema) -> None:
    schema = version_2.schema
    with _connect(version_2.dsn) as conn:
        _insert_old_rows(conn, schema, 14, 40)
        _insert_old_rows(conn, schema, 0, 10, tenant="recent")
        # A rolled-back insert consumed seq values beyond the highest row.
        conn.execute(sql.SQL("SELECT setval(pg_get_serial_sequence(%s, 'seq'), 900)"),
                     (f'"{schema}".{AUDIT}',))
    before = _rows(version_2.dsn, schema)
    # 3 converts the log; any later migration is applied after it.
    assert migrate(version_2.dsn, schema=schema, allow_second_copy=True) == list(
        range(3, preflight.required_version() + 1))
    assert _rows(version_2.dsn, schema) == before
    names = _partitions(version_2.dsn, schema)
    assert names[0] == f"{AUDIT}_legacy" and names[-1] == f"{AUDIT}_default"
    allow_test_clock(version_2.dsn, schema)
    with PostgresLeaseStore(version_2.dsn, settings=version_2.settings()) as store:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        identity = LeaseIdentity("new", "a", "b")
        assert gateway.acquire(identity, "c", scopes=[], ttl=30).ok
        assert gateway.acquire(identity, "d", scopes=[], ttl=30).ok is False
        records = store.audit(identity)
        # The identity carries on after every value the old sequence handed out.
        assert [r.seq for r in records] == [901, 902]
        # An event of the converted rows is still found (reconcile).
        assert store.event_committed(before[0][1]) is True
        assert store.event_committed(uuid.uuid4()) is False


def test_a_fresh_schema_has_months_ahead_and_migrate_keeps_them_coming(
        pg_migrated_schema_dsn: PgSchema) -> None:
    target = pg_migrated_schema_dsn
    names = _partitions(target.dsn, target.schema)
    monthly = [n for n in names if n[-6:].isdigit()]
    assert len(monthly) == 1 + retention.MONTHS_AHEAD, names
    assert names[-1] == f"{AUDIT}_default"
    with _connect(target.dsn) as conn:
        conn.execute(sql.SQL("ALTER TABLE {}.{} DETACH PARTITION {}.{}").format(
            *map(sql.Identifier, (target.schema, AUDIT, target.schema, monthly[-1]))))
        conn.execute(sql.SQL("DROP TABLE {}.{}").format(
            *map(sql.Identifier, (target.schema, monthly[-1]))))
    assert monthly[-1] not in _partitions(target.dsn, target.schema)
    assert migrate(target.dsn, schema=target.schema, allow_second_copy=True) == []
    assert _partitions(target.dsn, target.schema) == names


def _refusals(conn: psycopg.Connection[Any], schema: str, table: str) -> list[str]:
    """What each change of ``table``'s rows raised (a statement that went through is a
    failure of the test, named)."""
    target = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))
    outcomes = []
    for statement in (sql.SQL("UPDATE {} SET reason = 'lease_held', outcome = 'denied'"),
                      sql.SQL("DELETE FROM {}"),
                      sql.SQL("TRUNCATE {}")):
        try:
            conn.execute(statement.format(target))
            outcomes.append(f"ACCEPTED: {statement.format(target).as_string(conn)}")
        except psycopg.Error as exc:
            outcomes.append(type(exc).__name__)
    return outcomes


def test_every_partition_refuses_changes_for_every_role(
        pg_migrated_schema_dsn: PgSchema, pg_stores: StoreFactory) -> None:
    target = pg_migrated_schema_dsn
    store = pg_stores(target.dsn, settings=target.settings())
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    assert gateway.acquire(LeaseIdentity("t", "a", "b"), "c", scopes=[], ttl=30).ok
    with _connect(target.dsn) as conn:
        _insert_old_rows(conn, target.schema, 2, 3)  # into DEFAULT, then adopted
        conn.execute(sql.SQL("SELECT * FROM {}.mos_lease_audit_partitions(%s, 4)").format(
            sql.Identifier(target.schema)), (f'"{target.schema}".{AUDIT}',))
        names = [AUDIT, *_partitions(target.dsn, target.schema)]
        assert any(n.endswith(_month_name(conn, 2)) for n in names), names
        before = _rows(target.dsn, target.schema)
        # As the superuser that owns everything here: triggers hold for every role.
        for name in names:
            assert _refusals(conn, target.schema, name) == ["RestrictViolation"] * 3, name
    assert _rows(target.dsn, target.schema) == before


def _month_name(conn: psycopg.Connection[Any], months_ago: int) -> str:
    row = conn.execute("SELECT to_char(now() AT TIME ZONE 'UTC' - make_interval(months => %s),"
                       " 'YYYYMM')", (months_ago,)).fetchone()
    assert row is not None
    return str(row[0])


@pytest.fixture(scope="module")
def layout(pg_dsn: str) -> Iterator[Layout]:
    with psycopg.connect(pg_dsn, autocommit=True) as admin, role_layout(pg_dsn, admin) as built:
        yield built


def test_the_gateway_role_cannot_reach_a_partition(layout: Layout) -> None:
    names = _partitions(layout.owner_dsn, layout.schema)
    before = _rows(layout.owner_dsn, layout.schema)
    assert before  # the seeded lease's audit row
    with _connect(layout.gateway_dsn) as gateway:
        assert _refusals(gateway, layout.schema, AUDIT) == ["InsufficientPrivilege"] * 3
        for name in names:
            assert _refusals(gateway, layout.schema, name) == ["InsufficientPrivilege"] * 3
            table = sql.SQL("{}.{}").format(sql.Identifier(layout.schema), sql.Identifier(name))
            whole = sql.SQL("{}.{}").format(sql.Identifier(layout.schema),
                                            sql.Identifier(AUDIT))
            for statement in (
                    sql.SQL("SELECT count(*) FROM {}").format(table),
                    # OVERRIDING SYSTEM VALUE: PostgreSQL 18 checks the identity column
                    # before privileges, and the privilege is what is tested here.
                    sql.SQL("INSERT INTO {} OVERRIDING SYSTEM VALUE SELECT * FROM {} LIMIT 1")
                    .format(table, whole),
                    sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(whole, table),
                    sql.SQL("DROP TABLE {}").format(table),
                    sql.SQL("ALTER TABLE {} DISABLE TRIGGER ALL").format(table)):
                with pytest.raises(errors.InsufficientPrivilege):
                    gateway.execute(statement)
        with pytest.raises(errors.InsufficientPrivilege):
            gateway.execute(sql.SQL(
                "CREATE TABLE {}.squat PARTITION OF {}.{} FOR VALUES FROM ('2100-01-01')"
                " TO ('2100-02-01')").format(*map(sql.Identifier, (layout.schema,
                                                                   layout.schema, AUDIT))))
        with pytest.raises(errors.InsufficientPrivilege):
            gateway.execute(sql.SQL("SELECT * FROM {}.mos_lease_audit_partitions(%s, 1)")
                            .format(sql.Identifier(layout.schema)),
                            (f'"{layout.schema}".{AUDIT}',))
    # The retention commands refuse the gateway role before doing anything.
    with pytest.raises(retention.NotOwner, match="owner role"):
        retention.make_partitions(layout.gateway_dsn, layout.schema, 1)
    assert _partitions(layout.owner_dsn, layout.schema) == names
    assert _rows(layout.owner_dsn, layout.schema) == before


def test_rows_the_default_caught_are_adopted_whole(pg_migrated_schema_dsn: PgSchema,
                                                    pg_stores: StoreFactory) -> None:
    target = pg_migrated_schema_dsn
    # A store two years ahead: no partition exists for its month, and its writes still work.
    store = pg_stores(target.dsn, settings=target.settings(),
                      time_offset=timedelta(days=730))
    # Its ids are minted on its clock too: the log takes an id minted near its row's stamp.
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy(), id_source=lambda: uuid7(
        time.time_ns() + 730 * 86_400 * 10**9))
    identity = LeaseIdentity("future", "a", "b")
    assert gateway.acquire(identity, "c", scopes=[], ttl=30).ok
    assert gateway.acquire(identity, "d", scopes=[], ttl=30).ok is False
    before = _rows(target.dsn, target.schema)
    with _connect(target.dsn) as conn:
        caught = conn.execute(sql.SQL("SELECT count(*) FROM ONLY {}.{}").format(
            sql.Identifier(target.schema), sql.Identifier(f"{AUDIT}_default"))).fetchone()
        assert caught == (2,)
    made = retention.make_partitions(target.dsn, target.schema, 1)
    assert len(made) == 1, made  # the adopted partition; this month and next exist already
    with _connect(target.dsn) as conn:
        parts = {p.name: p for p in retention.partitions(conn, target.schema)}
        empty = conn.execute(sql.SQL("SELECT count(*) FROM ONLY {}.{}").format(
            sql.Identifier(target.schema), sql.Identifier(f"{AUDIT}_default"))).fetchone()
    assert empty == (0,)
    adopted = parts[made[0]]
    assert adopted.low is not None and adopted.high is not None
    assert all(adopted.low <= row[-1] < adopted.high for row in before if row[5] == "future")
    assert _rows(target.dsn, target.schema) == before
    # The new default is guarded like every partition.
    with _connect(target.dsn) as conn:
        assert _refusals(conn, target.schema, f"{AUDIT}_default") == ["RestrictViolation"] * 3
    assert gateway.acquire(LeaseIdentity("future", "a", "c"), "c", scopes=[], ttl=30).ok


def test_a_record_resent_concurrently_is_logged_once(pg_dsn: str, pg_tenant: str) -> None:
    # Many sessions append the same records at once (a resend racing the original): each
    # event id must end up in exactly one row.
    events = [uuid7() for _ in range(40)]
    statement = sql.SQL(
        "SELECT mos_lease.mos_lease_record_audit('mos_lease.connector_lease_audit_log',"
        " %s, 'acquire', 'denied', 'lease_held', %s, 'a', 'b', 'c', NULL, 'corr',"
        " clock_timestamp())")
    start = threading.Barrier(6)
    inserted: list[int] = []
    failures: list[BaseException] = []

    def append() -> None:
        try:
            with _connect(pg_dsn) as conn:
                start.wait()
                for event_id in events:
                    row = conn.execute(statement, (event_id, pg_tenant)).fetchone()
                    assert row is not None
                    inserted.append(row[0])
        except BaseException as exc:  # reported below
            failures.append(exc)

    workers = [threading.Thread(target=append) for _ in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert failures == []
    assert sum(inserted) == len(events)
    with _connect(pg_dsn) as conn:
        counts = conn.execute("SELECT event_id, count(*) FROM mos_lease.connector_lease_audit_log"
                              " WHERE tenant_id = %s GROUP BY 1", (pg_tenant,)).fetchall()
    assert sorted(c for _, c in counts) == [1] * len(events)


def test_a_record_on_a_store_still_keeps_its_contract(pg_stores: StoreFactory,
                                                       pg_tenant: str) -> None:
    store = pg_stores(settings=ConnectionSettings())
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "a", "b")
    assert gateway.acquire(identity, "c", scopes=[], ttl=30).ok
    denied = gateway.acquire(identity, "d", scopes=[], ttl=30)
    assert denied.ok is False
    (denial,) = [r for r in store.audit(identity) if r.entry.outcome.value == "denied"]
    store.record(denial.entry)  # a resend: no second row
    assert len(store.audit(identity)) == 2


def test_a_privilege_on_a_partition_is_reported_as_surplus(layout: Layout,
                                                           pg_dsn: str) -> None:
    with _connect(layout.gateway_dsn) as gateway:
        assert not any("partition" in s for s in preflight.check(gateway, layout.schema).surplus)
    name = _partitions(layout.owner_dsn, layout.schema)[0]
    table = sql.SQL("{}.{}").format(sql.Identifier(layout.schema), sql.Identifier(name))
    with _connect(pg_dsn) as admin:
        admin.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(
            table, sql.Identifier(layout.gateway)))
        try:
            with _connect(layout.gateway_dsn) as gateway:
                surplus = preflight.check(gateway, layout.schema).surplus
            assert f"privileges on 1 partition(s) of {AUDIT}" in surplus
        finally:
            admin.execute(sql.SQL("REVOKE SELECT ON {} FROM {}").format(
                table, sql.Identifier(layout.gateway)))
