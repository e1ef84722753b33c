"""Scenario 18: schema confusion -> 0 second copies, 0 two-holder outcomes, every error a
``ConfigurationError`` naming the fix.

A database of its own holds the tables in ``mos_lease``, migrated the way ``roles.sql``
sets the owner up (a search_path naming that schema). Then everything that once found the
tables through a search_path is tried, in order:

1. ``mos-lease status`` as ``postgres`` (search_path ``public``): must list the leases.
2. ``mos-lease migrate`` as ``postgres``: must build nothing (once it built a second set of
   tables in ``public``).
3. Two gateways, one connected with the owner's search_path and one as ``postgres``,
   acquire the same identity: exactly one may hold it (once both held it at epoch 1).
4. A role whose own search_path names ``public`` (``ALTER ROLE ... SET search_path``) with
   every grant it needs acquires an identity held by gateway 1: it must see that lease.
5. A database never migrated: a store and ``mos-lease status`` there must fail with a
   ``ConfigurationError`` that says to run ``mos-lease migrate --schema ...``.
6. A role missing a privilege (SELECT only): must fail with a ``ConfigurationError`` that
   says to run the roles step, never ``StoreUnavailable`` (which keepers retry).

Only APIs the library had before the schema became explicit are used (default schema,
DSNs, the CLI), so the same file shows the holes on the old code.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout

import attrs
import psycopg
import pytest
from psycopg import sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.cli import main as cli
from mos_lease.errors import ConfigurationError, MosLeaseError
from mos_lease_pg import PostgresLeaseStore
from mos_lease_pg.admin import migrate
from tests.faults.support import Table
from tests.pg_support import (
    PgServer,
    create_database,
    drop_database,
    in_schema,
    unique_name,
    with_params,
)

pytestmark = [pytest.mark.faults, pytest.mark.pg]

SCHEMA = "mos_lease"
FIXES = ("mos-lease migrate --schema", "roles step")
IDENT = LeaseIdentity("confusion", "agent", "main")


@attrs.define
class Outcome:
    probe: str
    expected: str  # "ok", "denied" or "configuration error"
    result: str  # "ok", "denied: <reason>", or the error's class and first line
    failed: bool = False
    # A library call: raised ConfigurationError with a fix in its message. A command: its
    # message names a fix (the CLI prints the error's text, not its class).
    names_fix: bool = False


def _names_fix(text: str) -> bool:
    return any(fix in text for fix in FIXES)


@attrs.define
class Site:
    server: PgServer
    dsn: str  # the scenario's database, as postgres (search_path "$user", public)
    bare: str  # a second database, never migrated
    roles: list[str] = attrs.field(factory=list)

    def role(self, grants: str, search_path: str | None = None) -> str:
        """A login role with ``grants`` (``{schema}`` and ``{role}`` filled in)."""
        name = unique_name("faults_sp")
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
            self.roles.append(name)
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(SCHEMA), sql.Identifier(name)))
            conn.execute(grants.replace("{schema}", SCHEMA).replace("{role}", name))
            if search_path is not None:
                conn.execute(sql.SQL("ALTER ROLE {} IN DATABASE {} SET search_path = {}").format(
                    sql.Identifier(name), sql.Identifier(conn.info.dbname),
                    sql.Identifier(search_path)))
        return with_params(self.dsn, user=name)


@pytest.fixture
def site(pg_server: PgServer) -> Iterator[Site]:
    names = unique_name("faults_schema"), unique_name("faults_bare")
    dsn, bare = (create_database(pg_server.dsn, name) for name in names)
    made = Site(pg_server, dsn, bare)
    try:
        yield made
    finally:
        for role in made.roles:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        for name in names:
            drop_database(pg_server.dsn, name)
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            for role in made.roles:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def _run_cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli(list(argv))
    return code, err.getvalue().strip()


def _cli_probe(probe: str, expected: str, *argv: str) -> Outcome:
    code, err = _run_cli(*argv)
    if code == 0:
        return Outcome(probe, expected, "ok")
    text = err.removeprefix("mos-lease: ")
    first = text.splitlines()[0][:200] if text else ""
    return Outcome(probe, expected, f"exit {code}: {first}", True, _names_fix(text))


def _call(probe: str, expected: str, action: Callable[[], object]) -> Outcome:
    try:
        result = action()
    except MosLeaseError as exc:
        return Outcome(probe, expected, f"{type(exc).__name__}: {str(exc)[:200]}", True,
                       isinstance(exc, ConfigurationError) and _names_fix(str(exc)))
    return Outcome(probe, expected, "ok" if result is None else str(result))


def _copies(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [name for (name,) in conn.execute(
            "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relname = 'logical_agent_connector_leases' ORDER BY 1")]


def _acquire(dsn: str, holders: list[tuple[str, int]], who: str) -> Callable[[], object]:
    def run() -> object:
        with PostgresLeaseStore(dsn) as store:
            result = ConnectorLeaseCoordinator(store, AllowAllPolicy()).acquire(
                IDENT, who, scopes=[], ttl=120)
        if result.lease is not None:
            holders.append((who, result.lease.epoch))
            return None
        return f"denied: {result.reason}"
    return run


def test_schema_confusion(site: Site, figures: Table) -> None:
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
    owner_like = in_schema(site.dsn, SCHEMA)  # roles.sql gives the owner this search_path
    migrate(owner_like)
    holders: list[tuple[str, int]] = []
    outcomes = [
        _call("gateway 1 (search_path mos_lease) acquires", "ok",
              _acquire(owner_like, holders, "gateway-1")),
        _cli_probe("status as postgres", "ok", "status", "--dsn", site.dsn, "--json"),
        _cli_probe("migrate as postgres", "ok", "migrate", "--dsn", site.dsn),
        _call("gateway 2 as postgres acquires the same identity", "denied",
              _acquire(site.dsn, holders, "gateway-2")),
    ]
    after_migrate = _copies(site.dsn)
    other_path = site.role("GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA {schema}"
                           " TO {role}", search_path="public")
    outcomes.append(_call("a role whose search_path is public acquires it", "denied",
                          _acquire(other_path, holders, "gateway-3")))
    outcomes.append(_call("store on an unmigrated database", "configuration error",
                          lambda: PostgresLeaseStore(site.bare).load(IDENT)))
    outcomes.append(_cli_probe("status on an unmigrated database", "configuration error",
                               "status", "--dsn", site.bare))
    select_only = site.role("GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}")
    outcomes.append(_call("a role with SELECT only acquires", "configuration error",
                          _acquire(in_schema(select_only, SCHEMA), holders, "gateway-4")))

    second_copies = len(_copies(site.dsn)) - 1
    epochs = [epoch for _, epoch in holders]
    two_holders = sum(epochs.count(e) - 1 for e in set(epochs))
    errors = [o for o in outcomes if o.failed]
    named = [o for o in errors if o.names_fix]
    wrong = [o for o in outcomes
             if (o.expected == "configuration error") != o.failed
             or (o.expected == "denied" and not o.result.startswith("denied"))]
    figures.add("probes", len(outcomes))
    figures.add("second copies of the tables", second_copies, "0", second_copies == 0)
    figures.add("schemas holding the tables after migrate as postgres",
                ", ".join(after_migrate), SCHEMA, after_migrate == [SCHEMA])
    figures.add("two-holder outcomes", two_holders, "0", two_holders == 0)
    figures.add("errors that are a ConfigurationError naming the fix",
                f"{len(named)} of {len(errors)}", "all", len(named) == len(errors))
    figures.add("probes not answered as expected", len(wrong), "0", not wrong)
    figures.notes += [f"{o.probe} -> {o.result}" for o in outcomes]
    print(f"\nscenario 18: {len(outcomes)} probes, {second_copies} second copies, "
          f"{two_holders} two-holder outcomes, {len(named)} of {len(errors)} errors a "
          "ConfigurationError naming the fix", flush=True)
    assert not figures.failed(), figures.render()
