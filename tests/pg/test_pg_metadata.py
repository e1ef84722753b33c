"""Holder metadata on PostgreSQL (migration 0007): set by acquire and takeover, kept by
heartbeat, the batched heartbeat and release, replaced by takeover, read by current_holder();
bad input writes nothing; never in an audit row or a notice payload; the database bounds the
column and lets only an insert or a takeover change it; a populated version-6 database
upgrades in place."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseIdentity,
)
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.admin import migrate
from mos_lease_pg.admin import migrations as migrations_module
from mos_lease_pg.statements import notice_channel
from tests.pg.test_pg_audit_integrity import _append
from tests.pg.test_pg_audit_partitions import _rows as _audit_rows
from tests.pg.test_pg_roles import Layout, role_layout
from tests.pg_fixtures import PgSchema, StoreFactory
from tests.pg_support import unique_name

pytestmark = pytest.mark.pg

ROUTE = {"endpoint": "10.0.0.7:8443", "zone": 'eu "west" ü 東京'}
LEASES = "logical_agent_connector_leases"
AUDIT = "connector_lease_audit_log"


def _gateway(pg_stores: StoreFactory) -> tuple[ConnectorLeaseCoordinator, PostgresLeaseStore]:
    store = pg_stores()
    return ConnectorLeaseCoordinator(store, AllowAllPolicy()), store


def test_metadata_is_set_kept_and_replaced(pg_stores: StoreFactory, pg_tenant: str) -> None:
    gateway, store = _gateway(pg_stores)
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    acquired = gateway.acquire(ident, "c1", scopes=[], ttl=30, metadata=ROUTE)
    assert acquired.lease is not None
    view = gateway.current_holder(ident)
    assert view is not None and view.metadata == ROUTE
    refused = gateway.acquire(ident, "c2", scopes=[], ttl=30, metadata={"endpoint": "x"})
    assert refused.holder is not None and refused.holder.metadata == ROUTE
    assert gateway.heartbeat(acquired.lease, ttl=30).ok
    assert gateway.heartbeat_many([acquired.lease], ttl=30)[0].ok
    assert gateway.current_holder(ident).metadata == ROUTE  # type: ignore[union-attr]
    assert gateway.release(acquired.lease).ok
    assert gateway.current_holder(ident).metadata == ROUTE  # type: ignore[union-attr]
    taken = gateway.takeover(ident, "c2", scopes=[], ttl=30, expected_epoch=1,
                             metadata={"endpoint": "10.0.0.8:8443"})
    assert taken.lease is not None
    assert gateway.current_holder(ident).metadata == {  # type: ignore[union-attr]
        "endpoint": "10.0.0.8:8443"}
    assert gateway.takeover(ident, "c3", scopes=[], ttl=30, expected_epoch=2).ok  # preempts
    assert gateway.current_holder(ident).metadata == {}  # type: ignore[union-attr]
    assert [row.metadata for row in store.leases(pg_tenant)] == [{}]


def test_the_largest_payload_the_library_allows_fits_the_database(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    gateway, _ = _gateway(pg_stores)
    ident = LeaseIdentity(pg_tenant, "agent", "big")
    # 16 entries, 2,048 bytes of keys and values, values of characters JSON escapes.
    biggest = {f"k{i:02d}": ('"\\' * 63)[:125] for i in range(16)}
    assert sum(len(k) + len(v.encode()) for k, v in biggest.items()) == 2048
    assert gateway.acquire(ident, "c1", scopes=[], ttl=30, metadata=biggest).ok
    assert gateway.current_holder(ident).metadata == biggest  # type: ignore[union-attr]


BAD: list[object] = [["endpoint"], {"endpoint": 8443}, {"endpoint": b"x"}, b"x",
                     {"k": "v" * 513}, {f"k{i}": "v" for i in range(17)}, {"k": "a\x00b"}]


@pytest.mark.parametrize("value", BAD)
def test_bad_metadata_writes_nothing(pg_stores: StoreFactory, pg_tenant: str,
                                     value: object) -> None:
    gateway, store = _gateway(pg_stores)
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    with pytest.raises(InvalidInput, match="metadata"):
        gateway.acquire(ident, "c1", scopes=[], ttl=30, metadata=value)  # type: ignore[arg-type]
    assert store.leases(pg_tenant) == [] and store.audit(ident) == []
    assert gateway.acquire(ident, "c1", scopes=[], ttl=30, metadata=ROUTE).ok
    before = (store.leases(pg_tenant), store.audit(ident))
    with pytest.raises(InvalidInput, match="metadata"):
        gateway.takeover(ident, "c2", scopes=[], ttl=30, expected_epoch=1,
                         metadata=value)  # type: ignore[arg-type]
    assert (store.leases(pg_tenant), store.audit(ident)) == before


def test_metadata_is_in_no_audit_row_and_no_notice(pg_stores: StoreFactory, pg_dsn: str,
                                                   pg_tenant: str) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    gateway, _ = _gateway(pg_stores)
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notice_channel())))
        first = gateway.acquire(ident, "c1", scopes=[], ttl=30, metadata={"endpoint": marker})
        assert first.lease is not None
        assert not gateway.acquire(ident, "c2", scopes=[], ttl=30,
                                   metadata={"endpoint": marker}).ok
        taken = gateway.takeover(ident, "c2", scopes=[], ttl=30, expected_epoch=1,
                                 metadata={"endpoint": marker})
        assert taken.lease is not None
        assert gateway.release(taken.lease).ok
        payloads = [n.payload for n in listener.notifies(timeout=5, stop_after=2)]
    # The takeover's and the release's notices came, and neither carries the metadata.
    assert sorted(json.loads(p)["k"] for p in payloads) == ["release", "takeover"]
    assert all(marker not in payload for payload in payloads)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT to_jsonb(a)::text FROM mos_lease.connector_lease_audit_log AS a"
            " WHERE tenant_id = %s ORDER BY seq", (pg_tenant,)).fetchall()
        stored = conn.execute(
            "SELECT holder_metadata FROM mos_lease.logical_agent_connector_leases"
            " WHERE tenant_id = %s", (pg_tenant,)).fetchone()
    assert len(rows) == 4  # acquire, refused acquire, takeover, release
    assert all(marker not in text for (text,) in rows)
    assert stored == ({"endpoint": marker},)  # it is in the lease row, and only there


# -- the database's own guard, for every role ------------------------------------------------


@pytest.fixture(scope="module")
def layout(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[Layout]:
    with role_layout(pg_dsn, pg_admin) as built:
        yield built


def _held(layout: Layout, binding: str) -> LeaseIdentity:
    ident = LeaseIdentity("metadata-guard", "agent", binding)
    with PostgresLeaseStore(layout.gateway_dsn,
                            settings=ConnectionSettings(schema=layout.schema)) as store:
        assert ConnectorLeaseCoordinator(store, AllowAllPolicy()).acquire(
            ident, "c1", scopes=[], ttl=60, metadata={"endpoint": "a:1"}).ok
    return ident


_NOW = "WITH t AS (SELECT clock_timestamp() AS now) "
_ROW = " FROM t WHERE tenant_id = 'metadata-guard' AND binding_id = %s"
# Each changes the metadata of an active row outside a takeover: refused by the guard.
OUTSIDE_A_TAKEOVER = {
    "alone": "UPDATE logical_agent_connector_leases SET holder_metadata = '{\"endpoint\":"
             " \"evil:1\"}' WHERE tenant_id = 'metadata-guard' AND binding_id = %s",
    "with a renewal": _NOW + "UPDATE logical_agent_connector_leases SET heartbeat_at = t.now,"
    " expires_at = t.now + interval '1 minute', updated_at = t.now,"
    " holder_metadata = '{\"endpoint\": \"evil:1\"}'" + _ROW,
    "with a release": _NOW + "UPDATE logical_agent_connector_leases SET released_at = t.now,"
    " updated_at = t.now, holder_metadata = '{}'" + _ROW,
}
# Refused by the CHECK whatever the write (here a takeover's shape, which may set it).
_TAKEOVER = (_NOW + "UPDATE logical_agent_connector_leases SET epoch = epoch + 1,"
             " lease_id = gen_random_uuid(), connector_id = 'c2', acquired_at = t.now,"
             " heartbeat_at = t.now, expires_at = t.now + interval '1 minute',"
             " updated_at = t.now, holder_metadata = {value}" + _ROW)
OUT_OF_BOUNDS = {
    "an array": "'[\"endpoint\"]'::jsonb",
    "a string": "'\"endpoint\"'::jsonb",
    "oversized": "jsonb_build_object('k', repeat('x', 5000))",
}


def _row(conn: psycopg.Connection[Any], ident: LeaseIdentity) -> Any:
    return conn.execute("SELECT * FROM logical_agent_connector_leases WHERE tenant_id = %s"
                        " AND binding_id = %s", (ident.tenant_id, ident.binding_id)).fetchone()


@pytest.mark.parametrize("role", ["gateway", "owner"])
@pytest.mark.parametrize("name", sorted(OUTSIDE_A_TAKEOVER))
def test_metadata_changes_only_with_a_takeover(layout: Layout, role: str, name: str) -> None:
    ident = _held(layout, f"{name}-{role}")
    dsn = layout.gateway_dsn if role == "gateway" else layout.owner_dsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = _row(conn, ident)
        with pytest.raises(errors.RestrictViolation, match="holder metadata change only"):
            conn.execute(OUTSIDE_A_TAKEOVER[name].encode(), (ident.binding_id,))
        assert _row(conn, ident) == before


@pytest.mark.parametrize("name", sorted(OUT_OF_BOUNDS))
def test_the_database_bounds_the_column(layout: Layout, name: str) -> None:
    ident = _held(layout, f"bounds-{name}")
    with psycopg.connect(layout.gateway_dsn, autocommit=True) as conn:
        before = _row(conn, ident)
        # 0010's rule (a trigger) or 0007's CHECK, whichever PostgreSQL reaches first.
        with pytest.raises(errors.CheckViolation, match=r"metadata_check|holder metadata"):
            conn.execute(_TAKEOVER.format(value=OUT_OF_BOUNDS[name]).encode(),
                         (ident.binding_id,))
        assert _row(conn, ident) == before


def test_a_takeover_shaped_write_may_set_it(layout: Layout) -> None:
    ident = _held(layout, "takeover-by-hand")
    with psycopg.connect(layout.gateway_dsn, autocommit=True) as conn:
        conn.execute(_TAKEOVER.format(value="'{\"endpoint\": \"b:2\"}'").encode(),
                     (ident.binding_id,))
        row = conn.execute("SELECT epoch, holder_metadata FROM logical_agent_connector_leases"
                           " WHERE tenant_id = %s AND binding_id = %s",
                           (ident.tenant_id, ident.binding_id)).fetchone()
    assert row == (2, {"endpoint": "b:2"})


# -- upgrading a populated database ----------------------------------------------------------


@pytest.fixture
def version_6(pg_schema_dsn: PgSchema) -> Iterator[PgSchema]:
    """A schema migrated to version 6 only: a database of the field before 0007."""
    with psycopg.connect(pg_schema_dsn.dsn, autocommit=True) as conn:
        migrations_module._ensure_bookkeeping(conn, pg_schema_dsn.schema)
        for migration in migrations_module.available_migrations()[:6]:
            migrations_module._apply(conn, pg_schema_dsn.schema, migration, True)
    yield pg_schema_dsn


def _populate(conn: psycopg.Connection[Any], schema: str) -> None:
    """Leases as version 6's statements leave them (acquired, taken over, released), each
    write with its audit row."""
    table = sql.Identifier(schema, LEASES)
    for n in range(5):
        conn.execute(sql.SQL(
            "WITH t AS (SELECT clock_timestamp() AS now) INSERT INTO {} (tenant_id,"
            " logical_agent_id, binding_id, lease_id, connector_id, allowed_scopes, epoch,"
            " acquired_at, heartbeat_at, expires_at, released_at, updated_at)"
            " SELECT 'old', 'agent', %s, gen_random_uuid(), 'c1', ARRAY['tool:run'], 1, t.now,"
            " t.now, t.now + interval '1 minute', NULL, t.now FROM t").format(table),
            (f"b{n}",))
        _append(conn, schema, uuid.uuid4())
    conn.execute(sql.SQL(
        "WITH t AS (SELECT clock_timestamp() AS now) UPDATE {} SET epoch = epoch + 1,"
        " lease_id = gen_random_uuid(), connector_id = 'c2', acquired_at = t.now,"
        " heartbeat_at = t.now, expires_at = t.now + interval '1 minute', updated_at = t.now"
        " FROM t WHERE binding_id IN ('b1', 'b2')").format(table))
    conn.execute(sql.SQL(
        "WITH t AS (SELECT clock_timestamp() AS now) UPDATE {} SET released_at = t.now,"
        " updated_at = t.now FROM t WHERE binding_id = 'b2'").format(table))
    for _ in range(3):
        _append(conn, schema, uuid.uuid4())


def _leases(conn: psycopg.Connection[Any], schema: str, columns: str = "*") -> Any:
    return conn.execute(sql.SQL("SELECT " + columns + " FROM {} ORDER BY binding_id").format(
        sql.Identifier(schema, LEASES))).fetchall()


def test_a_populated_version_6_database_upgrades_in_place(
        version_6: PgSchema, pg_admin: psycopg.Connection[Any]) -> None:
    schema = version_6.schema
    grantee = unique_name("gw")
    pg_admin.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(grantee)))
    try:
        pg_admin.execute(sql.SQL("GRANT UPDATE (lease_id, epoch) ON {} TO {}").format(
            sql.Identifier(schema, LEASES), sql.Identifier(grantee)))
        with psycopg.connect(version_6.dsn, autocommit=True) as conn:
            _populate(conn, schema)
            leases_before = _leases(conn, schema)
        audit_before = _audit_rows(version_6.dsn, schema)
        assert len(leases_before) == 5 and len(audit_before) == 8

        assert migrate(version_6.dsn, schema=schema,
                       allow_second_copy=True) == [7, 8, 9, 10, 11]

        with psycopg.connect(version_6.dsn, autocommit=True) as conn:
            # Every row as it was, each with empty metadata in the new last column.
            assert [row[:-1] for row in _leases(conn, schema)] == leases_before
            assert {row[-1] for row in _leases(conn, schema, "holder_metadata::text")} == {
                "{}"}
            may_update = conn.execute(
                "SELECT has_column_privilege(%s, %s, 'holder_metadata', 'UPDATE')",
                (grantee, f'"{schema}".{LEASES}')).fetchone()
        assert may_update == (True,)  # whoever could rotate a lease may set its metadata
        assert _audit_rows(version_6.dsn, schema) == audit_before

        with PostgresLeaseStore(version_6.dsn, settings=version_6.settings()) as store:
            gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
            old = LeaseIdentity("old", "agent", "b2")
            view = gateway.current_holder(old)
            assert view is not None and view.epoch == 2 and view.metadata == {}
            assert gateway.takeover(old, "c3", scopes=[], ttl=30, expected_epoch=2,
                                    metadata=ROUTE).ok
            assert gateway.current_holder(old).metadata == ROUTE  # type: ignore[union-attr]
            assert gateway.acquire(LeaseIdentity("old", "agent", "new"), "c1", scopes=[],
                                   ttl=30, metadata={"endpoint": "n:1"}).ok
        assert _audit_rows(version_6.dsn, schema)[:8] == audit_before
    finally:
        pg_admin.execute(sql.SQL("REVOKE ALL ON {} FROM {}").format(
            sql.Identifier(schema, LEASES), sql.Identifier(grantee)))
        pg_admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(grantee)))
