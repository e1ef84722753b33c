"""Fenced effects as the least-privilege gateway role, on a real server.

A fenced transaction writes the application's own tables as the gateway role. Without a
grant on such a table, or with a table or lease schema that does not exist, the server's
refusal is configuration: it is raised as :class:`ConfigurationError` naming the fix, as
the store raises it (never a raw ``InsufficientPrivilege``). ``mos-lease roles
--effect-table schema.table`` grants the gateway role what fenced effects need (USAGE on the
schema, the privileges on the table, USAGE on its serial sequences), in the same
transaction as the role layout: a table that does not exist grants nothing at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease import (
    AllowAllPolicy,
    ConfigurationError,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    Reason,
)
from mos_lease.fencing import FencedEffectRefused
from mos_lease_pg import ConnectionSettings
from mos_lease_pg.admin import cli
from mos_lease_pg.effects import fenced_transaction, fenced_transaction_async
from tests.pg.test_pg_roles import Layout, role_layout
from tests.pg_fixtures import StoreFactory
from tests.pg_support import unique_name, with_params

pytestmark = pytest.mark.pg

SCOPES = ("outbox:write",)


@pytest.fixture(scope="module")
def layout(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[Layout]:
    with role_layout(pg_dsn, pg_admin) as built:
        yield built


@pytest.fixture
def app(pg_admin: psycopg.Connection[Any]) -> Iterator[str]:
    """An application schema with an outbox (a serial column: its INSERT draws from a
    sequence) made by the administrator, as an application's migrations would."""
    schema = unique_name("app")
    pg_admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    pg_admin.execute(sql.SQL("CREATE TABLE {} (seq bigserial PRIMARY KEY, epoch bigint NOT "
                             "NULL, body text NOT NULL)")
                     .format(sql.Identifier(schema, "outbox")))
    try:
        yield schema
    finally:
        pg_admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def context(layout: Layout, pg_stores: StoreFactory) -> ConnectorExecutionContext:
    """A context the gateway role's own coordinator validated."""
    store = pg_stores(layout.gateway_dsn, settings=ConnectionSettings(schema=layout.schema))
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity("tenant", unique_name("agent"), "outbox")
    lease = gateway.acquire(identity, "conn-a", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=30).grant
    assert grant is not None
    checked = gateway.validate(grant, identity=identity, scopes=SCOPES)
    assert checked.context is not None
    return checked.context


def roles(layout: Layout, pg_dsn: str, *extra: str) -> int:
    return cli.main(["roles", "--dsn", pg_dsn, "--schema", layout.schema, "--owner-role",
                     layout.owner, "--gateway-role", layout.gateway, *extra])


def write(dsn: str, context: ConnectorExecutionContext, table: str, *,
          schema: str) -> None:
    with psycopg.connect(dsn) as conn, \
            fenced_transaction(conn, context, scopes=SCOPES, schema=schema) as cur:
        cur.execute(sql.SQL("INSERT INTO {} (epoch, body) VALUES (%s, %s)")
                    .format(sql.SQL(table)), (context.epoch, "hello"))


def rows(pg_admin: psycopg.Connection[Any], app: str) -> list[tuple[Any, ...]]:
    return pg_admin.execute(sql.SQL("SELECT seq, epoch, body FROM {}").format(
        sql.Identifier(app, "outbox"))).fetchall()


def test_without_a_grant_the_effect_names_the_roles_recipe_and_with_it_commits(
        layout: Layout, pg_dsn: str, pg_admin: psycopg.Connection[Any], app: str,
        context: ConnectorExecutionContext) -> None:
    with pytest.raises(ConfigurationError) as refused:
        write(layout.gateway_dsn, context, f"{app}.outbox", schema=layout.schema)
    message = str(refused.value)
    assert f"role {layout.gateway} may not write" in message
    assert f"mos-lease roles --effect-table {app}." in message
    assert isinstance(refused.value.__cause__, psycopg.errors.InsufficientPrivilege)
    assert rows(pg_admin, app) == []

    assert roles(layout, pg_dsn, "--effect-table", f"{app}.outbox") == 0
    write(layout.gateway_dsn, context, f"{app}.outbox", schema=layout.schema)
    assert rows(pg_admin, app) == [(1, context.epoch, "hello")]  # the serial's sequence too
    granted = pg_admin.execute(
        "SELECT string_agg(privilege_type, ',' ORDER BY privilege_type)"
        " FROM information_schema.role_table_grants"
        " WHERE grantee = %s AND table_schema = %s AND table_name = 'outbox'",
        (layout.gateway, app)).fetchone()
    assert granted == ("DELETE,INSERT,SELECT,UPDATE",)


def test_a_narrower_grant_refuses_what_it_leaves_out(
        layout: Layout, pg_dsn: str, pg_admin: psycopg.Connection[Any], app: str,
        context: ConnectorExecutionContext) -> None:
    assert roles(layout, pg_dsn, "--effect-table", f"{app}.outbox",
                 "--effect-privileges", "insert") == 0
    write(layout.gateway_dsn, context, f"{app}.outbox", schema=layout.schema)
    with pytest.raises(ConfigurationError, match=r"--effect-table SCHEMA\.outbox"), \
            psycopg.connect(layout.gateway_dsn) as conn, \
            fenced_transaction(conn, context, scopes=SCOPES, schema=layout.schema) as cur:
        cur.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(app, "outbox")))
    assert len(rows(pg_admin, app)) == 1  # the DELETE was refused and rolled back


def test_a_missing_effect_table_is_configuration_in_sync_and_async(
        layout: Layout, pg_dsn: str, app: str, context: ConnectorExecutionContext) -> None:
    assert roles(layout, pg_dsn, "--effect-table", f"{app}.outbox") == 0
    with pytest.raises(ConfigurationError, match=rf'create {app}\.nowhere .*schema\.table'):
        write(layout.gateway_dsn, context, f"{app}.nowhere", schema=layout.schema)

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(layout.gateway_dsn) as conn, \
                fenced_transaction_async(conn, context, scopes=SCOPES,
                                         schema=layout.schema) as cur:
            await cur.execute(f"INSERT INTO {app}.nowhere VALUES (1)")

    with pytest.raises(ConfigurationError, match="does not exist") as refused:
        asyncio.run(run())
    assert isinstance(refused.value.__cause__, psycopg.errors.UndefinedTable)


def test_the_lease_check_names_the_schema_or_the_gateway_role(
        layout: Layout, pg_dsn: str, pg_admin: psycopg.Connection[Any],
        context: ConnectorExecutionContext) -> None:
    missing = unique_name("nowhere")
    with pytest.raises(ConfigurationError, match=rf"no lease table {missing}\..*schema="):
        write(layout.gateway_dsn, context, "unused", schema=missing)
    stranger = unique_name("stranger")
    pg_admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(stranger)))
    try:
        with pytest.raises(ConfigurationError,
                           match=rf"role {stranger} may not read the lease table") as refused:
            write(with_params(pg_dsn, user=stranger), context, "unused", schema=layout.schema)
        assert isinstance(refused.value.__cause__, psycopg.errors.InsufficientPrivilege)
    finally:
        pg_admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(stranger)))


def test_a_refusal_is_still_a_refusal(layout: Layout, pg_dsn: str, app: str,
                                      context: ConnectorExecutionContext) -> None:
    assert roles(layout, pg_dsn, "--effect-table", f"{app}.outbox") == 0
    with pytest.raises(FencedEffectRefused) as refused, \
            psycopg.connect(layout.gateway_dsn) as conn, \
            fenced_transaction(conn, context, scopes=("other:scope",), schema=layout.schema):
        pass
    assert refused.value.reason is Reason.SCOPE_NOT_AUTHORIZED


def test_a_missing_table_grants_nothing_at_all(
        layout: Layout, pg_dsn: str, pg_admin: psycopg.Connection[Any], app: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert roles(layout, pg_dsn, "--effect-table", f"{app}.outbox",
                 "--effect-table", f"{app}.missing") == 1
    assert f"effect table {app}.missing does not exist" in capsys.readouterr().err
    usable = pg_admin.execute("SELECT has_schema_privilege(%s, %s, 'USAGE')",
                              (layout.gateway, app)).fetchone()
    assert usable == (False,)  # one transaction: the outbox's grants were not kept


@pytest.mark.parametrize(("option", "value", "said"), [
    ("--effect-table", "outbox", "schema.table"),
    ("--effect-table", "App.Outbox", "schema.table"),
    ("--effect-table", "a.b.c", "schema.table"),
    ("--effect-table", "LAYOUT.logical_agent_connector_leases", "holds the mos-lease tables"),
    ("--effect-privileges", "truncate", "not one of SELECT, INSERT, UPDATE, DELETE"),
    ("--effect-privileges", ",", "name at least one"),
])
def test_bad_effect_options_are_refused_before_anything_is_sent(
        layout: Layout, pg_dsn: str, pg_admin: psycopg.Connection[Any], app: str,
        capsys: pytest.CaptureFixture[str], option: str, value: str, said: str) -> None:
    given = value.replace("LAYOUT", layout.schema)
    extra = [option, given] if option == "--effect-table" else [
        "--effect-table", f"{app}.outbox", option, given]
    assert roles(layout, pg_dsn, *extra) == 1
    assert said in capsys.readouterr().err
    usable = pg_admin.execute("SELECT has_schema_privilege(%s, %s, 'USAGE')",
                              (layout.gateway, app)).fetchone()
    assert usable == (False,)


def test_print_shows_the_effect_grants(layout: Layout, app: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["roles", "--print", "--schema", layout.schema, "--gateway-role",
                     layout.gateway, "--effect-table", f"{app}.outbox",
                     "--effect-privileges", "select,insert"]) == 0
    printed = capsys.readouterr().out
    assert f'GRANT USAGE ON SCHEMA "{app}" TO "{layout.gateway}";' in printed
    assert f'GRANT SELECT, INSERT ON TABLE "{app}"."outbox" TO "{layout.gateway}";' in printed
