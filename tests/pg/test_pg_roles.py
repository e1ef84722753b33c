"""The least-privilege role layout (``sql/roles.sql``), proved on a real server.

Roles are cluster-wide, so this test makes its own with unique names and drops them at the
end. It connects as the gateway role and shows that the store can do everything it needs
(the whole lifecycle, a reconciled write, the inspection views, the resource-epoch table)
and nothing else; then it shows that the schema itself refuses what must never happen even
to the owner: changing or removing audit rows, deleting lease rows, lowering an epoch.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import errors, sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.admin import apply_roles, migrate
from mos_lease_pg.sql_files import sql_text
from tests.pg_fixtures import StoreFactory
from tests.pg_support import FaultProxy, unique_name, with_params

pytestmark = pytest.mark.pg


@attrs.frozen
class Layout:
    owner: str
    gateway: str
    schema: str
    owner_dsn: str
    gateway_dsn: str


def _apply(dsn: str, admin: psycopg.Connection[Any], names: dict[str, str]) -> None:
    psql = shutil.which("psql")
    if psql is None:
        apply_roles(admin, **names)
        return
    # The documented way: psql with -v variables runs the file itself.
    args = [psql, "-q", "-X", "-d", dsn]
    for key, value in names.items():
        args += ["-v", f"{key}={value}"]
    with_file = sql_text("roles.sql")
    subprocess.run([*args, "-f", "-"], input=with_file, text=True, check=True,
                   capture_output=True, timeout=60)


@contextmanager
def role_layout(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[Layout]:
    """Owner and gateway roles of unique names (roles are cluster-wide) and their schema,
    migrated as the owner, with one seeded lease; all dropped afterwards. Also used by the
    transition and privilege-abuse tests."""
    names = {"owner_role": unique_name("mos_lease_owner"),
             "gateway_role": unique_name("mos_lease_gateway"),
             "schema_name": unique_name("mos_lease")}
    try:
        _apply(pg_dsn, pg_admin, names)  # roles and schema
        owner_dsn = with_params(pg_dsn, user=names["owner_role"])
        # As the owner (it owns every object), into the layout's schema: a second copy,
        # since the run's database holds the tables in mos_lease too.
        migrate(owner_dsn, schema=names["schema_name"], allow_second_copy=True)
        _apply(pg_dsn, pg_admin, names)  # again: grants on the tables that now exist
        gateway_dsn = with_params(pg_dsn, user=names["gateway_role"])
        _seed(gateway_dsn, names["schema_name"])
        yield Layout(names["owner_role"], names["gateway_role"], names["schema_name"],
                     owner_dsn, gateway_dsn)
    finally:
        pg_admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                         .format(sql.Identifier(names["schema_name"])))
        for role in (names["gateway_role"], names["owner_role"]):
            exists = pg_admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
            if exists.fetchone() is not None:
                pg_admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                pg_admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture(scope="module")
def layout(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[Layout]:
    with role_layout(pg_dsn, pg_admin) as built:
        yield built


def test_objects_belong_to_the_owner_in_its_schema(layout: Layout,
                                                   pg_admin: psycopg.Connection[Any]) -> None:
    owned = pg_admin.execute(
        "SELECT c.relname, pg_get_userbyid(c.relowner) FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind IN ('r', 'p') AND NOT c.relispartition"
        " ORDER BY 1", (layout.schema,)).fetchall()
    assert owned == [(table, layout.owner) for table in (
        "connector_lease_audit_log", "connector_lease_event_ids", "connector_resource_epochs",
        "logical_agent_connector_leases", "mos_lease_audit_retention",
        "mos_lease_schema_migrations", "mos_lease_settings")]


def test_gateway_privileges_are_exactly_the_documented_ones(
        layout: Layout, pg_admin: psycopg.Connection[Any]) -> None:
    # Table-wide privileges, then the UPDATE columns (column grants are listed apart).
    tables = pg_admin.execute(
        "SELECT table_name, string_agg(privilege_type, ',' ORDER BY privilege_type)"
        " FROM information_schema.role_table_grants"
        " WHERE grantee = %s AND table_schema = %s GROUP BY 1 ORDER BY 1",
        (layout.gateway, layout.schema)).fetchall()
    assert tables == [("connector_lease_audit_log", "INSERT,SELECT"),
                      ("connector_lease_event_ids", "SELECT"),
                      ("connector_resource_epochs", "INSERT,SELECT"),
                      ("logical_agent_connector_leases", "INSERT,SELECT")]
    updatable = pg_admin.execute(
        "SELECT table_name, string_agg(column_name, ',' ORDER BY column_name)"
        " FROM information_schema.column_privileges"
        " WHERE grantee = %s AND table_schema = %s AND privilege_type = 'UPDATE'"
        " GROUP BY 1 ORDER BY 1", (layout.gateway, layout.schema)).fetchall()
    assert updatable == [
        ("connector_resource_epochs", "highest_epoch,updated_at"),
        ("logical_agent_connector_leases", "acquired_at,allowed_scopes,connector_id,epoch,"
         "expires_at,heartbeat_at,holder_metadata,lease_id,released_at,updated_at")]
    executable = pg_admin.execute(
        "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s AND has_function_privilege(%s, p.oid, 'EXECUTE')",
        (layout.schema, layout.gateway)).fetchall()
    # The one function a gateway calls: the resendable audit record (migration 0003), in
    # its one-record form and its set form (0011).
    assert executable == [("mos_lease_record_audit",), ("mos_lease_record_audit",)]


def test_gateway_can_do_what_the_store_needs(layout: Layout, pg_stores: StoreFactory) -> None:
    store = pg_stores(layout.gateway_dsn, settings=ConnectionSettings(schema=layout.schema))
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    ident = LeaseIdentity("tenant", "agent", "b1")
    first = gateway.acquire(ident, "c1", scopes=["tool:run"], ttl=30)
    assert first.lease is not None
    assert gateway.acquire(ident, "c2", scopes=["tool:run"], ttl=30).ok is False
    assert gateway.heartbeat(first.lease, ttl=30).ok
    assert all(r.ok for r in gateway.heartbeat_many([first.lease], ttl=30))
    grant = gateway.issue_grant(first.lease, scopes=["tool:run"], ttl=5).grant
    assert grant is not None
    assert gateway.validate(grant, identity=ident, scopes=["tool:run"]).ok
    second = gateway.takeover(ident, "c2", scopes=["tool:run"], ttl=30, expected_epoch=1)
    assert second.lease is not None
    assert not gateway.validate(grant, identity=ident, scopes=["tool:run"]).ok
    assert gateway.release(second.lease).ok
    assert [r.epoch for r in store.leases("tenant")] == [2]
    # acquire, refused acquire, heartbeat, batched heartbeat, grant issue, takeover,
    # refused validation, release (successful validations are not audited)
    assert len(store.audit(ident)) == len(store.search_audit(tenant_id="tenant")) == 8
    # Reconciling a write whose reply was lost needs the settling row lock (FOR UPDATE).
    proxy = FaultProxy(layout.gateway_dsn)
    try:
        flaky = ConnectorLeaseCoordinator(
            pg_stores(proxy.dsn, settings=ConnectionSettings(prepare=False, schema=layout.schema)),
            AllowAllPolicy())
        proxy.cut_reply_to(b"epoch = l.epoch + 1")
        third = flaky.takeover(ident, "c3", scopes=["tool:run"], ttl=30, expected_epoch=2)
        assert third.ok and third.reconciled
    finally:
        proxy.close()
    # The downstream resource-epoch table: read, insert, raise.
    with psycopg.connect(layout.gateway_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO connector_resource_epochs VALUES"
                     " ('r1', 'tenant', 'agent', 'b1', 1, now())")
        conn.execute("UPDATE connector_resource_epochs SET highest_epoch = 2")
        assert conn.execute("SELECT highest_epoch FROM connector_resource_epochs"
                            ).fetchall() == [(2,)]


GATEWAY_REFUSED = [
    "UPDATE connector_lease_audit_log SET reason = 'x'",
    "DELETE FROM connector_lease_audit_log",
    "TRUNCATE connector_lease_audit_log",
    "DELETE FROM logical_agent_connector_leases",
    "TRUNCATE logical_agent_connector_leases",
    "UPDATE logical_agent_connector_leases SET tenant_id = 'elsewhere'",
    "SELECT * FROM mos_lease_schema_migrations",
    "DELETE FROM connector_resource_epochs",
    "UPDATE connector_resource_epochs SET resource_id = 'other'",
    "SELECT * FROM mos_lease_settings",
    "UPDATE mos_lease_settings SET clock_allowance = interval '1 day'",
    "CREATE TABLE sneaky (x int)",
    "CREATE TABLE public.sneaky (x int)",
]

EVERYONE_REFUSED = [
    "UPDATE connector_lease_audit_log SET connector_id = 'x'",
    "DELETE FROM connector_lease_audit_log",
    "TRUNCATE connector_lease_audit_log",
    "DELETE FROM logical_agent_connector_leases",
    "TRUNCATE logical_agent_connector_leases",
    "UPDATE logical_agent_connector_leases SET epoch = epoch - 1",
    "UPDATE logical_agent_connector_leases SET binding_id = 'other'",
    "UPDATE logical_agent_connector_leases SET epoch = epoch + 1",
    "DELETE FROM connector_resource_epochs",
    "TRUNCATE connector_resource_epochs",
]


def _seed(dsn: str, schema: str) -> None:
    """One lease at epoch 2 in tenant "seed", with its two audit rows."""
    with PostgresLeaseStore(dsn, settings=ConnectionSettings(schema=schema)) as store:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        ident = LeaseIdentity("seed", "a", "b")
        assert gateway.acquire(ident, "c1", scopes=[], ttl=30).ok
        assert gateway.takeover(ident, "c2", scopes=[], ttl=30, expected_epoch=1).ok


def _audit_rows(conn: psycopg.Connection[Any]) -> Any:
    return conn.execute(b"SELECT * FROM connector_lease_audit_log ORDER BY seq").fetchall()


def test_gateway_is_refused_everything_else(layout: Layout) -> None:
    with psycopg.connect(layout.gateway_dsn, autocommit=True) as conn:
        before = _audit_rows(conn)
        for statement in GATEWAY_REFUSED:
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement.encode())
        # UPDATE of the epoch column is granted (takeover needs it); lowering it is not.
        with pytest.raises(errors.RestrictViolation, match="never go backwards"):
            conn.execute(b"UPDATE logical_agent_connector_leases SET epoch = epoch - 1")
        assert _audit_rows(conn) == before


def test_the_schema_refuses_even_the_owner(layout: Layout) -> None:
    with psycopg.connect(layout.owner_dsn, autocommit=True) as conn:
        before = _audit_rows(conn)
        lease = conn.execute(b"SELECT * FROM logical_agent_connector_leases").fetchall()
        for statement in EVERYONE_REFUSED:
            with pytest.raises(errors.RestrictViolation, match="is refused"):
                conn.execute(statement.encode())
        assert _audit_rows(conn) == before
        assert conn.execute(b"SELECT * FROM logical_agent_connector_leases").fetchall() == lease
        # A DBA fences every outstanding token the way a takeover does: the epoch rises by
        # one together with a new lease UUID and fresh times (an epoch alone may not rise).
        conn.execute(b"WITH t AS (SELECT clock_timestamp() AS now)"
                     b" UPDATE logical_agent_connector_leases SET epoch = epoch + 1,"
                     b" lease_id = gen_random_uuid(), acquired_at = t.now, heartbeat_at = t.now,"
                     b" expires_at = t.now + interval '1 minute', updated_at = t.now"
                     b" FROM t WHERE tenant_id = 'seed'")
        raised = conn.execute(b"SELECT epoch FROM logical_agent_connector_leases"
                              b" WHERE tenant_id = 'seed'").fetchall()
    assert raised == [(3,)]
