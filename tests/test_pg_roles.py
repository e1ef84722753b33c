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
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import errors, sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore, apply_roles, migrate
from mos_lease_pg.statements import sql_text
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


@pytest.fixture(scope="module")
def layout(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[Layout]:
    names = {"owner_role": unique_name("mos_lease_owner"),
             "gateway_role": unique_name("mos_lease_gateway"),
             "schema_name": unique_name("mos_lease")}
    try:
        _apply(pg_dsn, pg_admin, names)  # roles and schema
        owner_dsn = with_params(pg_dsn, user=names["owner_role"])
        migrate(owner_dsn)  # as the owner: it owns every object
        _apply(pg_dsn, pg_admin, names)  # again: grants on the tables that now exist
        gateway_dsn = with_params(pg_dsn, user=names["gateway_role"])
        _seed(gateway_dsn)
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


def test_objects_belong_to_the_owner_in_its_schema(layout: Layout,
                                                   pg_admin: psycopg.Connection[Any]) -> None:
    owned = pg_admin.execute(
        "SELECT c.relname, pg_get_userbyid(c.relowner) FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind = 'r' ORDER BY 1", (layout.schema,)).fetchall()
    assert owned == [(table, layout.owner) for table in (
        "connector_lease_audit_log", "connector_resource_epochs",
        "logical_agent_connector_leases", "mos_lease_schema_migrations")]


def test_gateway_can_do_what_the_store_needs(layout: Layout, pg_stores: StoreFactory) -> None:
    store = pg_stores(layout.gateway_dsn)
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
            pg_stores(proxy.dsn, settings=ConnectionSettings(prepare=False)), AllowAllPolicy())
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
]


def _seed(dsn: str) -> None:
    """One lease at epoch 2 in tenant "seed", with its two audit rows."""
    with PostgresLeaseStore(dsn) as store:
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
        # Raising an epoch (a DBA fencing every outstanding token) is allowed.
        conn.execute(b"UPDATE logical_agent_connector_leases SET epoch = epoch + 1"
                     b" WHERE tenant_id = 'seed'")
        raised = conn.execute(b"SELECT epoch FROM logical_agent_connector_leases"
                              b" WHERE tenant_id = 'seed'").fetchall()
    assert raised == [(3,)]
