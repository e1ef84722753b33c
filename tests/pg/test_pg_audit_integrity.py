"""The audit log's integrity, held by the database (migration 0004), for every role and
every path: an event id is applied at most once, whatever write kind carries it and in
whichever month its rows would land; audit rows are stamped by the database clock only; a
month that retention archived never receives a row again, and its archive entry is never
overwritten; rows the DEFAULT partition caught in several months are adopted, each month on
its own; a populated log of version 3 upgrades in place."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql

from mos_lease import (
    AllowAllPolicy,
    CommitOutcomeUnknown,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
)
from mos_lease.errors import InternalInconsistency
from mos_lease.ids import uuid7
from mos_lease.machine import Close, Insert, Renew, Rotate
from mos_lease.records import AuditEntry, LeaseRow
from mos_lease_pg import PostgresLeaseStore
from mos_lease_pg.admin import archive as retention
from mos_lease_pg.admin import migrate
from mos_lease_pg.admin import migrations as migrations_module
from tests.pg.test_pg_audit_partitions import AUDIT, _insert_old_rows, _partitions, _rows
from tests.pg.test_pg_roles import Layout, role_layout
from tests.pg.test_pg_store import TTL, entry_for
from tests.pg_fixtures import PgSchema, StoreFactory

pytestmark = pytest.mark.pg

EVENT_TIME = "connector_lease_audit_log_event_id_time"
STAMP_REFUSED = r"stamped by the database clock|finite"
COLUMNS = ("event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id, "
           "connector_id, epoch, correlation_id, recorded_at")


def _count(dsn: str, schema: str, event_id: uuid.UUID) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}.{} WHERE event_id = %s").format(
            sql.Identifier(schema), sql.Identifier(AUDIT)), (event_id,)).fetchone()
    assert row is not None
    return int(row[0])


def _append(conn: psycopg.Connection[Any], schema: str, event_id: uuid.UUID,
            stamp: str = "clock_timestamp()", params: tuple[Any, ...] = ()) -> None:
    conn.execute(sql.SQL("INSERT INTO {}.{} (" + COLUMNS + ") VALUES (%s, 'acquire', "
                         "'denied', 'lease_held', 'forger', 'a', 'b', 'c', 1, 'corr', "
                         + stamp + ")").format(sql.Identifier(schema), sql.Identifier(AUDIT)),
                 (event_id, *params))


def _lease(store: PostgresLeaseStore, identity: LeaseIdentity) -> LeaseRow:
    write = Insert(identity, uuid.uuid4(), "c1", ("tool:run",), TTL)
    row = store.apply(write, entry_for(write)).row
    assert row is not None
    return row


def _renew(row: LeaseRow, identity: LeaseIdentity) -> Renew:
    return Renew(identity, row.connector_id, row.lease_id, row.epoch, TTL)


# Each kind: (the write applied once, the same event sent again as a write that would
# otherwise apply). Returns what the lease row must still be after the refusal.
def _acquire(store: PostgresLeaseStore, tenant: str) -> tuple[AuditEntry, Callable[[], Any]]:
    first = Insert(LeaseIdentity(tenant, "a", "b1"), uuid.uuid4(), "c1", (), TTL)
    entry = entry_for(first)
    assert store.apply(first, entry).row is not None
    other = LeaseIdentity(tenant, "a", "b2")  # a fresh identity: the insert would apply

    def again() -> Any:
        store.apply(Insert(other, uuid.uuid4(), "c1", (), TTL), entry)
    return entry, again


def _heartbeat(store: PostgresLeaseStore, tenant: str) -> tuple[AuditEntry, Callable[[], Any]]:
    identity = LeaseIdentity(tenant, "a", "b1")
    renew = _renew(_lease(store, identity), identity)
    entry = entry_for(renew)
    assert store.apply(renew, entry).row is not None
    return entry, lambda: store.apply(renew, entry)


def _heartbeat_many(store: PostgresLeaseStore,
                    tenant: str) -> tuple[AuditEntry, Callable[[], Any]]:
    identities = [LeaseIdentity(tenant, "a", f"b{n}") for n in range(3)]
    renewals = [(renew, entry_for(renew)) for renew in
                (_renew(_lease(store, identity), identity) for identity in identities)]
    assert all(o.row is not None for o in store.renew_many(renewals))
    # The same batch again: each renewal would apply.
    return renewals[1][1], lambda: store.renew_many(renewals)


def _takeover(store: PostgresLeaseStore, tenant: str) -> tuple[AuditEntry, Callable[[], Any]]:
    identity = LeaseIdentity(tenant, "a", "b1")
    row = _lease(store, identity)
    rotate = Rotate(identity, row.epoch, True, uuid.uuid4(), "c2", (), TTL)
    entry = entry_for(rotate)
    assert store.apply(rotate, entry).row is not None
    next_rotate = Rotate(identity, row.epoch + 1, True, uuid.uuid4(), "c3", (), TTL)
    return entry, lambda: store.apply(next_rotate, entry)


def _release(store: PostgresLeaseStore, tenant: str) -> tuple[AuditEntry, Callable[[], Any]]:
    identity = LeaseIdentity(tenant, "a", "b1")
    row = _lease(store, identity)
    close = Close(identity, row.connector_id, row.lease_id, row.epoch)
    entry = entry_for(close)
    assert store.apply(close, entry).row is not None
    taken = store.apply(rotate := Rotate(identity, row.epoch, True, uuid.uuid4(), "c1",
                                         (), TTL), entry_for(rotate)).row
    assert taken is not None
    return entry, lambda: store.apply(Close(identity, "c1", taken.lease_id, taken.epoch), entry)


KINDS = {"acquire": _acquire, "heartbeat": _heartbeat, "heartbeat_many": _heartbeat_many,
         "takeover": _takeover, "release": _release}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_write_sent_again_under_an_applied_event_id_is_refused_by_the_database(
        pg_store: PostgresLeaseStore, pg_dsn: str, pg_tenant: str, kind: str) -> None:
    entry, again = KINDS[kind](pg_store, pg_tenant)
    leases_before = {i: pg_store.load(i).row for i in _identities(pg_tenant)}
    with pytest.raises(CommitOutcomeUnknown, match="applied already"):
        again()
    # Nothing of the second attempt happened: no lease row changed, no second audit row.
    assert {i: pg_store.load(i).row for i in _identities(pg_tenant)} == leases_before
    assert _count(pg_dsn, "mos_lease", entry.event_id) == 1
    assert pg_store.event_committed(entry.event_id)


def _identities(tenant: str) -> list[LeaseIdentity]:
    return [LeaseIdentity(tenant, "a", f"b{n}") for n in range(4)]


def test_a_record_or_a_plain_insert_of_an_applied_event_id_is_refused_in_any_month(
        pg_store: PostgresLeaseStore, pg_dsn: str, pg_tenant: str) -> None:
    entry, _again = _heartbeat(pg_store, pg_tenant)
    # The resendable record looks first: another record under that id is a bug, raised.
    clash = AuditEntry(entry.event_id, entry.event, entry.outcome, None, entry.identity,
                       entry.connector_id, entry.epoch, "another")
    with pytest.raises(InternalInconsistency, match="already recorded"):
        pg_store.record(clash)
    # Any other path, by any role with the triggers on: in this month (its partition's unique
    # index), or in another month's partition, which takes no id minted this far from it.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(errors.UniqueViolation, match="_event_id_idx"):
            _append(conn, "mos_lease", entry.event_id)
        with pytest.raises(errors.CheckViolation, match=EVENT_TIME):
            _append(conn, "mos_lease", entry.event_id, "clock_timestamp() + interval '62 days'")
    assert _count(pg_dsn, "mos_lease", entry.event_id) == 1


def _month_turn(months_ahead: int) -> datetime:
    now = datetime.now(UTC)
    month = now.month - 1 + months_ahead
    return datetime(now.year + month // 12, month % 12 + 1, 1, tzinfo=UTC)


# An id minted within a day of a month's turn may lie in the partitions on both sides of it:
# (which turn, in months after this month's start; the id's minting time, then the two rows'
# stamps, in seconds from that turn). The test schema has partitions for this month and the
# three after it, and the DEFAULT catches the months after those.
TWICE = {
    "minted before the turn, stamped on both sides": (2, -3600, -7200, 600),
    "minted after the turn, stamped on both sides": (2, 3600, -600, 7200),
    "minted almost a day before the turn": (2, -86_000, -86_300, 60),
    "minted before the turn, stamped twice before it": (2, -3600, -7200, -60),
    "stamped in a partition, then in the DEFAULT": (4, -60, -120, 120),
    "stamped twice in the DEFAULT": (4, 3600, 60, 7200),
}


@pytest.mark.parametrize("case", TWICE)
def test_an_event_id_near_a_month_turn_is_applied_once_on_either_side(
        pg_store: PostgresLeaseStore, pg_dsn: str, case: str) -> None:
    ahead, minted, first, second = TWICE[case]
    turn = _month_turn(ahead).timestamp()
    event_id = uuid7(int((turn + minted) * 1e9))
    stamp = "%s::timestamptz"  # ahead of the clock: the test schema allows that (10 years)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        _append(conn, "mos_lease", event_id, stamp, (datetime.fromtimestamp(turn + first, UTC),))
        with pytest.raises(errors.UniqueViolation,
                           match=r"connector_lease_event_ids_pkey|_event_id_idx"):
            _append(conn, "mos_lease", event_id, stamp,
                    (datetime.fromtimestamp(turn + second, UTC),))
    assert _count(pg_dsn, "mos_lease", event_id) == 1


# Ids the log takes no more: not time-ordered, or minted too far from the month they would
# be stamped in (a month's partition, or the DEFAULT beyond the partitions made).
FOREIGN = {
    "a random (version 4) id": (uuid.uuid4, 0),
    "an id minted two days before its month": (lambda: uuid7_days(-2), 1),
    "an id minted a year ahead": (lambda: uuid7_days(365), 0),
    "an id minted a day away from its stamp in the DEFAULT": (lambda: uuid7_days(150), 151),
}


def uuid7_days(days: float) -> uuid.UUID:
    """An id minted ``days`` from the start of next month."""
    return uuid7(int((_month_turn(1).timestamp() + days * 86400) * 1e9))


@pytest.mark.parametrize("case", FOREIGN)
def test_an_event_id_not_minted_near_its_month_is_refused(
        pg_store: PostgresLeaseStore, pg_dsn: str, case: str) -> None:
    mint, stamped_days = FOREIGN[case]
    event_id = mint()
    at = datetime.fromtimestamp(_month_turn(1).timestamp() + stamped_days * 86400 + 3600, UTC)
    with (psycopg.connect(pg_dsn, autocommit=True) as conn,
          pytest.raises(errors.CheckViolation, match=EVENT_TIME)):
        _append(conn, "mos_lease", event_id, "%s::timestamptz", (at,))
    assert _count(pg_dsn, "mos_lease", event_id) == 0


@pytest.fixture(scope="module")
def layout(pg_dsn: str) -> Iterator[Layout]:
    with psycopg.connect(pg_dsn, autocommit=True) as admin, role_layout(pg_dsn, admin) as built:
        yield built


@pytest.mark.parametrize("stamp", ["clock_timestamp() - interval '40 days'",
                                   "clock_timestamp() - interval '1 second'",
                                   "clock_timestamp() + interval '1 hour'",
                                   "'-infinity'", "statement_timestamp() - interval '1 ms'"])
def test_the_gateway_role_cannot_stamp_an_audit_row(layout: Layout, stamp: str) -> None:
    with psycopg.connect(layout.gateway_dsn, autocommit=True) as conn:
        _append(conn, layout.schema, uuid7())  # its own clock's time: accepted
        with pytest.raises(errors.RestrictViolation, match=STAMP_REFUSED):
            _append(conn, layout.schema, uuid7(), stamp)
        # The record function takes no offset any more, and holds its stamp to the clock.
        offset_kind = conn.execute(sql.SQL(
            "SELECT to_regprocedure(%s)"), (
            f"{layout.schema}.mos_lease_record_audit(regclass, uuid, text, text, text, text, "
            "text, text, text, bigint, text, interval)",)).fetchone()
        assert offset_kind == (None,)
        with pytest.raises(errors.RestrictViolation, match=STAMP_REFUSED):
            conn.execute(sql.SQL(
                "SELECT {}.mos_lease_record_audit({}, %s, 'acquire', 'denied', 'lease_held', "
                "'t', 'a', 'b', 'c', NULL, 'corr', " + stamp + ")").format(
                sql.Identifier(layout.schema),
                sql.Literal(f'"{layout.schema}".{AUDIT}')), (uuid7(),))


def _this_month() -> date:
    now = datetime.now(UTC)
    return date(now.year, now.month, 1)


@pytest.fixture
def archived(pg_migrated_schema_dsn: PgSchema, tmp_path: Path) -> Iterator[tuple[PgSchema, Path]]:
    """A schema whose month three months ago (25 rows) was archived to a directory."""
    target = pg_migrated_schema_dsn
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        _insert_old_rows(conn, target.schema, 3, 25, tenant="m3")
    retention.make_partitions(target.dsn, target.schema, 3)
    report = retention.archive(target.dsn, target.schema, _this_month(), tmp_path)
    assert [e.digest.rows for e in report.archived] == [25]
    yield target, tmp_path


def _months_ago(months: int) -> str:
    return (f"(date_trunc('month', now() AT TIME ZONE 'UTC') - interval '{months} months') "
            "AT TIME ZONE 'UTC' + interval '5 minutes'")


def test_an_archived_month_never_receives_a_row_again(archived: tuple[PgSchema, Path],
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    target, directory = archived
    manifest = (directory / retention.MANIFEST).read_bytes()
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        # With the triggers on (any role): the stamp is not the clock's.
        with pytest.raises(errors.RestrictViolation):
            _append(conn, target.schema, uuid.uuid4(), _months_ago(3))
        # Even with them off (a superuser's replica mode): the DEFAULT refuses the month.
        for months in (3, 4):
            with pytest.raises(errors.CheckViolation, match="retained_check"), \
                    conn.transaction():
                conn.execute("SET LOCAL session_replication_role = replica")
                _append(conn, target.schema, uuid.uuid4(), _months_ago(months))
    # So the routine steps find nothing to adopt or archive, and the archive is intact.
    retention.make_partitions(target.dsn, target.schema, 3)
    report = retention.archive(target.dsn, target.schema, _this_month(), directory)
    assert report.archived == ()
    assert (directory / retention.MANIFEST).read_bytes() == manifest
    assert retention.verify(directory)[1] == []


def test_an_archive_entry_is_never_overwritten_or_shrunk(archived: tuple[PgSchema, Path]
                                                         ) -> None:
    target, directory = archived
    [entry] = retention.read_manifest(directory).values()
    saved = (directory / entry.file).read_bytes()
    # The owner rebuilds a partition of that name and bounds by hand, with one row.
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.{} PARTITION OF {}.{} FOR VALUES FROM ({}) "
                             "TO ({})").format(
            sql.Identifier(target.schema), sql.Identifier(entry.partition),
            sql.Identifier(target.schema), sql.Identifier(AUDIT), sql.Literal(entry.low),
            sql.Literal(entry.high)))
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            _append(conn, target.schema, uuid.uuid4(), _months_ago(3))
    with pytest.raises(retention.ArchiveConflict, match="1 in the table") as refused:
        retention.archive(target.dsn, target.schema, _this_month(), directory)
    assert "25 rows archived" in str(refused.value) and entry.partition in str(refused.value)
    assert (directory / entry.file).read_bytes() == saved
    assert retention.read_manifest(directory)[entry.partition] == entry
    assert entry.partition in _partitions(target.dsn, target.schema)  # not dropped


def _month_start(offset: int) -> datetime:
    now = datetime.now(UTC)
    month = now.year * 12 + now.month - 1 + offset
    return datetime(month // 12, month % 12 + 1, 1, tzinfo=UTC)


def _minted(moment: datetime) -> uuid.UUID:
    """An event id minted at ``moment``, for a row stamped then (migration 0009)."""
    return uuid7(int(moment.timestamp() * 1e9))


def test_rows_of_months_around_an_existing_partition_are_adopted_each_on_its_own(
        pg_migrated_schema_dsn: PgSchema) -> None:
    target = pg_migrated_schema_dsn
    retention.make_partitions(target.dsn, target.schema, 3)
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        # Month +6 has a partition; months +5 and +7 do not, so their rows land in DEFAULT.
        conn.execute(sql.SQL("CREATE TABLE {}.{} PARTITION OF {}.{} FOR VALUES FROM ({}) TO "
                             "({})").format(
            sql.Identifier(target.schema), sql.Identifier("by_hand"),
            sql.Identifier(target.schema), sql.Identifier(AUDIT),
            sql.Literal(_month_start(6)), sql.Literal(_month_start(7))))
        for months in (5, 7, 7):
            _append(conn, target.schema, _minted(_month_start(months) + timedelta(hours=1)),
                    "%s::timestamptz + interval '1 hour'", (_month_start(months),))
    before = _rows(target.dsn, target.schema)
    made = retention.make_partitions(target.dsn, target.schema, 3)
    assert made == [f"{AUDIT}_p{_month_start(5):%Y%m}", f"{AUDIT}_p{_month_start(7):%Y%m}"]
    assert _rows(target.dsn, target.schema) == before
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        left = conn.execute(sql.SQL("SELECT count(*) FROM ONLY {}.{}").format(
            sql.Identifier(target.schema), sql.Identifier(f"{AUDIT}_default"))).fetchone()
        assert left == (0,)
        # The adopted months are guarded and claim event ids like every partition.
        [(event_id,)] = conn.execute(sql.SQL("SELECT event_id FROM {}.{} LIMIT 1").format(
            sql.Identifier(target.schema), sql.Identifier(made[0]))).fetchall()
        with pytest.raises(errors.UniqueViolation):
            _append(conn, target.schema, event_id)
        # A statement naming a partition (the owner may) claims through its own trigger.
        named = _minted(_month_start(7) + timedelta(hours=2))
        # OVERRIDING SYSTEM VALUE: from PostgreSQL 17 a partition has the log's identity column.
        conn.execute(sql.SQL("INSERT INTO {}.{} (seq, " + COLUMNS + ") OVERRIDING SYSTEM VALUE "
                             "VALUES (nextval("
                             "pg_get_serial_sequence(%s, 'seq')), %s, 'acquire', 'denied', "
                             "'lease_held', 'owner', 'a', 'b', 'c', 1, 'corr', "
                             "%s::timestamptz + interval '2 hours')").format(
            sql.Identifier(target.schema), sql.Identifier(made[1])),
            (f'"{target.schema}".{AUDIT}', named, _month_start(7)))
        with pytest.raises(errors.UniqueViolation):
            _append(conn, target.schema, named)
        with pytest.raises(errors.RestrictViolation):
            conn.execute(sql.SQL("DELETE FROM {}.{}").format(sql.Identifier(target.schema),
                                                             sql.Identifier(made[1])))


@pytest.fixture
def version_3(pg_schema_dsn: PgSchema) -> Iterator[PgSchema]:
    """A schema migrated to version 3 only: a database of the field before 0004."""
    with psycopg.connect(pg_schema_dsn.dsn, autocommit=True) as conn:
        migrations_module._ensure_bookkeeping(conn, pg_schema_dsn.schema)
        for migration in migrations_module.available_migrations()[:3]:
            migrations_module._apply(conn, pg_schema_dsn.schema, migration, True)
    yield pg_schema_dsn


def test_a_populated_version_3_log_upgrades_in_place(version_3: PgSchema,
                                                     pg_stores: StoreFactory) -> None:
    schema = version_3.schema
    twice = uuid.uuid4()
    with psycopg.connect(version_3.dsn, autocommit=True) as conn:
        _insert_old_rows(conn, schema, 2, 20, tenant="old")
        retention.make_partitions(version_3.dsn, schema, 3)
        for _ in range(2):  # an id twice, as version 3 let a resent write do
            _append(conn, schema, twice)
        _append(conn, schema, uuid.uuid4())
    before = _rows(version_3.dsn, schema)
    assert migrate(version_3.dsn, schema=schema,
                   allow_second_copy=True) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert _rows(version_3.dsn, schema) == before
    with psycopg.connect(version_3.dsn, autocommit=True) as conn:
        claims = conn.execute(sql.SQL("SELECT count(*) FROM {}.connector_lease_event_ids")
                              .format(sql.Identifier(schema))).fetchone()
        assert claims == (len(before) - 1,)
        with pytest.raises(errors.UniqueViolation):
            _append(conn, schema, twice)
        with pytest.raises(errors.UniqueViolation):  # an id of a past month's row
            _append(conn, schema, before[0][1])
    store = pg_stores(version_3.dsn, settings=version_3.settings())
    identity = LeaseIdentity("upgraded", "a", "b")
    row = _lease(store, identity)
    renew = _renew(row, identity)
    entry = entry_for(renew)
    assert store.apply(renew, entry).row is not None
    with pytest.raises(CommitOutcomeUnknown, match="applied already"):
        store.apply(renew, entry)
    assert _count(version_3.dsn, schema, entry.event_id) == 1


def test_the_clock_allowance_of_a_test_database_only_reaches_ahead(
        pg_migrated_schema_dsn: PgSchema) -> None:
    target = pg_migrated_schema_dsn  # allow_test_clock: stamps up to years ahead
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        _append(conn, target.schema, _minted(datetime.now(UTC) + timedelta(days=3)),
                "clock_timestamp() + interval '3 days'")
        with pytest.raises(errors.RestrictViolation, match="stamped by the database clock"):
            _append(conn, target.schema, _minted(datetime.now(UTC) - timedelta(days=3)),
                    "clock_timestamp() - interval '3 days'")


# An id source of another version, or a clock a month behind the database's (one a day and
# a half behind is refused only near the turn of a month: TWICE and FOREIGN above).
@pytest.mark.parametrize("source", ["random", "a month behind"])
def test_a_coordinator_minting_ids_the_log_refuses_gets_a_configuration_error(
        pg_store: PostgresLeaseStore, pg_dsn: str, pg_tenant: str, source: str) -> None:
    ids = {"random": uuid.uuid4,
           "a month behind": lambda: uuid7(time.time_ns() - 33 * 86_400 * 10**9)}[source]
    gateway = ConnectorLeaseCoordinator(pg_store, AllowAllPolicy(), id_source=ids)
    identity = LeaseIdentity(pg_tenant, "a", "refused-ids")
    with pytest.raises(ConfigurationError, match=r"time-ordered \(version 7\) UUID"):
        gateway.acquire(identity, "c1", scopes=[], ttl=30)
    assert gateway.current_holder(identity) is None
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL("SELECT count(*) FROM mos_lease.{} WHERE tenant_id = %s")
                            .format(sql.Identifier(AUDIT)), (pg_tenant,)).fetchone()
    assert rows == (0,)
