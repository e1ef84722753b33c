"""The PostgreSQL commands (``setup``, ``roles``, ``migrate``, ``status``, ``audit``) as
registered on an argparse parser, run against a real server; ``check`` has its own file."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import psycopg
import pytest
from psycopg import sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.errors import ConfigurationError
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.admin import available_migrations
from tests.pg_fixtures import PgSchema, StoreFactory
from tests.pg_fixtures import run_cli as run
from tests.pg_support import PgServer, create_database, drop_database, unique_name, with_params

pytestmark = pytest.mark.pg


@pytest.fixture
def history(pg_stores: StoreFactory, pg_tenant: str) -> str:
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    first = gateway.acquire(LeaseIdentity(pg_tenant, "agent", "b1"), "c1", scopes=["tool:run"],
                            ttl=60, metadata={"endpoint": "replaced:1"})
    assert first.lease is not None
    assert not gateway.acquire(LeaseIdentity(pg_tenant, "agent", "b1"), "c2", scopes=[],
                               ttl=60).ok
    assert gateway.takeover(LeaseIdentity(pg_tenant, "agent", "b1"), "c2", scopes=[], ttl=60,
                            expected_epoch=1).ok
    assert gateway.acquire(LeaseIdentity(pg_tenant, "agent", "b2"), "c3", scopes=[], ttl=60,
                           metadata={"endpoint": "10.0.0.7:8443", "zone": "eu west"}).ok
    return pg_tenant


def test_status_json(pg_dsn: str, history: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("status", "--dsn", pg_dsn, "--tenant", history, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert [(lease["binding_id"], lease["connector_id"], lease["epoch"], lease["state"])
            for lease in report["leases"]] == [("b1", "c2", 2, "active"), ("b2", "c3", 1, "active")]
    assert report["now"] and report["leases"][0]["scopes"] == []
    assert "lease_id" not in report["leases"][0]
    # The takeover replaced c1's metadata with none; c3's is shown as it was set.
    assert [lease["metadata"] for lease in report["leases"]] == [
        {}, {"endpoint": "10.0.0.7:8443", "zone": "eu west"}]


def test_status_text(pg_dsn: str, history: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("status", "--dsn", pg_dsn, "--tenant", history) == 0
    out = capsys.readouterr().out
    assert "2 lease(s)" in out
    lines = out.splitlines()
    assert lines[1].split() == ["TENANT", "AGENT", "BINDING", "CONNECTOR", "EPOCH", "STATE",
                                "EXPIRES", "METADATA"]
    assert lines[2].split()[:6] == [history, "agent", "b1", "c2", "2", "active"]
    assert lines[2].split()[-1] == "-"
    assert lines[3].endswith('{"endpoint":"10.0.0.7:8443","zone":"eu west"}')


def test_audit_json(pg_dsn: str, history: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("audit", "--dsn", pg_dsn, "--tenant", history, "--binding", "b1", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    records = report["records"]
    assert [(r["event"], r["outcome"], r["reason"], r["connector_id"], r["epoch"])
            for r in records] == [("acquire", "acquired", None, "c1", 1),
                                  ("acquire", "denied", "lease_held", "c2", None),
                                  ("takeover", "taken_over", None, "c2", 2)]
    assert report["last_seq"] == records[-1]["seq"]
    # Paging: after the first record, at most one.
    assert run("audit", "--dsn", pg_dsn, "--tenant", history, "--after-seq",
               str(records[0]["seq"]), "--limit", "1", "--json") == 0
    page = json.loads(capsys.readouterr().out)["records"]
    assert [r["seq"] for r in page] == [records[1]["seq"]]


def test_audit_text(pg_dsn: str, history: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("audit", "--dsn", pg_dsn, "--tenant", history, "--limit", "2") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["SEQ", "RECORDED", "EVENT"]
    assert "lease_held" in out[2] and f"{history}/agent/b1" in out[2]
    assert out[-1].startswith("(more may follow: --after-seq")
    assert run("audit", "--dsn", pg_dsn, "--tenant", f"{history}-none") == 0
    assert capsys.readouterr().out.strip() == "no audit records"


def test_migrate_and_dsn_and_schema_from_the_environment(
        pg_schema_dsn: PgSchema, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MOS_LEASE_DSN", pg_schema_dsn.dsn)
    monkeypatch.setenv("MOS_LEASE_SCHEMA", pg_schema_dsn.schema)
    latest = max(m.version for m in available_migrations())
    versions = ", ".join(str(m.version) for m in available_migrations())
    # The run's database holds the tables in mos_lease: a second copy only when asked for.
    assert run("migrate") == 1
    assert "--allow-second-copy" in capsys.readouterr().err
    assert run("migrate", "--allow-second-copy") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"applied migrations: {versions}",
        f"next: as a superuser, `mos-lease roles --schema {pg_schema_dsn.schema}` so the "
        "gateway role may use the tables",
        f"schema {pg_schema_dsn.schema} version: {latest}"]
    assert run("migrate") == 0  # this schema holds the tables now: nothing new is built
    assert capsys.readouterr().out.splitlines() == [
        "schema is up to date", f"schema {pg_schema_dsn.schema} version: {latest}"]
    assert run("status", "--json") == 0
    assert json.loads(capsys.readouterr().out)["leases"] == []


def test_errors_are_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    nowhere = "host=127.0.0.1 port=1 dbname=x user=x connect_timeout=2"
    for argv in (("status", "--dsn", nowhere), ("audit", "--dsn", nowhere),
                 ("migrate", "--dsn", nowhere), ("audit", "--dsn", nowhere, "--limit", "0")):
        assert run(*argv) == 1
        assert capsys.readouterr().err.startswith("mos-lease: ")


# --- setting up a new database -------------------------------------------------------------


@attrs.frozen
class Fresh:
    """A database of its own with no mos-lease objects, and role names no other test uses
    (roles are cluster-wide). ``dsn`` connects as the server's superuser."""

    dsn: str
    owner: str
    gateway: str

    def layout(self) -> tuple[str, ...]:
        return ("--owner-role", self.owner, "--gateway-role", self.gateway)

    def as_gateway(self) -> str:
        return with_params(self.dsn, user=self.gateway)

    def as_owner(self) -> str:
        return with_params(self.dsn, user=self.owner)


@contextmanager
def fresh_database(pg_server: PgServer) -> Iterator[Fresh]:
    """A :class:`Fresh` database and role names, dropped afterwards."""
    name = unique_name("mos_lease_fresh")
    made = Fresh(create_database(pg_server.dsn, name), unique_name("mos_lease_owner"),
                 unique_name("mos_lease_gateway"))
    try:
        yield made
    finally:
        # The roles own objects only in this database: dropping it frees them.
        drop_database(pg_server.dsn, name)
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            for role in (made.gateway, made.owner):
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@pytest.fixture
def fresh(pg_server: PgServer) -> Iterator[Fresh]:
    with fresh_database(pg_server) as made:
        yield made


def gateway_works(dsn: str, schema: str = "mos_lease") -> None:
    """Acquire, issue a grant and validate it as a store on ``dsn`` (raises if it cannot)."""
    with PostgresLeaseStore(dsn, settings=ConnectionSettings(schema=schema)) as store:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        ident = LeaseIdentity("t", "agent", unique_name("b"))
        lease = gateway.acquire(ident, "c1", scopes=["tool:run"], ttl=30).lease
        assert lease is not None
        grant = gateway.issue_grant(lease, scopes=["tool:run"], ttl=5).grant
        assert grant is not None
        assert gateway.validate(grant, identity=ident, scopes=["tool:run"]).ok


def _owners(dsn: str, schema: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT pg_get_userbyid(c.relowner) FROM pg_class c JOIN pg_namespace n"
            " ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'"
            " UNION SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = %s",
            (schema, schema)).fetchall()
    return {owner for (owner,) in rows}


def test_setup_on_a_fresh_database_is_all_a_gateway_needs(
        fresh: Fresh, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("setup", "--dsn", fresh.dsn, *fresh.layout()) == 0
    latest = max(m.version for m in available_migrations())
    versions = ", ".join(str(m.version) for m in available_migrations())
    assert capsys.readouterr().out.splitlines() == [
        f"roles: created role {fresh.owner}, role {fresh.gateway}, schema mos_lease",
        f"migrate (as {fresh.owner}): applied migrations {versions}",
        f"roles: granted {fresh.gateway} its privileges on the tables of mos_lease",
        f"schema mos_lease version: {latest}",
        f"gateways connect as {fresh.gateway}; `mos-lease check` as that role verifies it"]
    # No extra step: the gateway role acquires and validates at once.
    gateway_works(fresh.as_gateway())
    # The owner role owns the schema and every table, not the superuser that ran setup.
    assert _owners(fresh.dsn, "mos_lease") == {fresh.owner}
    # Again: nothing to create or apply, and the gateway still works.
    assert run("setup", "--dsn", fresh.dsn, *fresh.layout()) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"roles: {fresh.owner}, {fresh.gateway} and schema mos_lease exist",
                       f"migrate (as {fresh.owner}): schema is up to date"]
    gateway_works(fresh.as_gateway())
    assert run("check", "--dsn", fresh.as_gateway()) == 0


def test_setup_respects_schema_and_owner_dsn(fresh: Fresh,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    schema = unique_name("s")
    # The owner role does not exist yet, so --owner-dsn cannot be used on a first setup:
    # it is refused with the server's reason, and the roles step it ran is kept.
    assert run("setup", "--dsn", fresh.dsn, *fresh.layout(), "--schema", schema,
               "--owner-dsn", with_params(fresh.dsn, user="no_such_role_h")) == 1
    assert "mos-lease: " in capsys.readouterr().err
    assert run("setup", "--dsn", fresh.dsn, *fresh.layout(), "--schema", schema,
               "--owner-dsn", fresh.as_owner()) == 0
    assert f"roles: granted {fresh.gateway} its privileges on the tables of {schema}" in (
        capsys.readouterr().out)
    assert _owners(fresh.dsn, schema) == {fresh.owner}
    gateway_works(fresh.as_gateway(), schema)
    with pytest.raises(ConfigurationError, match="does not exist"):
        gateway_works(fresh.as_gateway())  # nothing was built in the default schema


def test_roles_then_migrate_alone_locks_the_gateway_out_until_roles_runs_again(
        fresh: Fresh, capsys: pytest.CaptureFixture[str]) -> None:
    # The order the documentation used to give: the role step, then migrate as the owner.
    assert run("roles", "--dsn", fresh.dsn, *fresh.layout()) == 0
    first = capsys.readouterr().out
    assert "has no mos-lease tables yet" in first and "run this role step again" in first
    assert run("migrate", "--dsn", fresh.as_owner()) == 0
    assert "next: as a superuser, `mos-lease roles" in capsys.readouterr().out
    with pytest.raises(ConfigurationError, match="lacks SELECT on logical_agent_connector"):
        gateway_works(fresh.as_gateway())
    # The role step is safe after migrate too, and is the missing step.
    assert run("roles", "--dsn", fresh.dsn, *fresh.layout()) == 0
    assert "has no mos-lease tables yet" not in capsys.readouterr().out
    gateway_works(fresh.as_gateway())
    assert run("roles", "--dsn", fresh.dsn, *fresh.layout()) == 0  # and idempotent
    gateway_works(fresh.as_gateway())


def test_roles_print_is_the_installed_script_with_the_values_filled_in(
        fresh: Fresh, capsys: pytest.CaptureFixture[str]) -> None:
    schema = unique_name("s")
    assert run("roles", "--print", *fresh.layout(), "--schema", schema,
               "--statement-timeout", "750ms") == 0
    script = capsys.readouterr().out
    assert f"'{schema}'" in script and f"'{fresh.gateway}'" in script and "'750ms'" in script
    assert ":'" not in script
    assert not [line for line in script.splitlines() if line.lstrip().startswith("\\")]
    # It runs as printed, in psql where installed (as an operator would), else the driver.
    psql = shutil.which("psql")
    if psql is not None:
        subprocess.run([psql, "-q", "-X", "-v", "ON_ERROR_STOP=1", "-d", fresh.dsn, "-f", "-"],
                       input=script, text=True, check=True, capture_output=True, timeout=60)
    else:
        with psycopg.connect(fresh.dsn, autocommit=True) as conn:
            conn.execute(script.encode())
    with psycopg.connect(fresh.dsn) as conn:
        assert conn.execute("SELECT pg_get_userbyid(nspowner) FROM pg_namespace"
                            " WHERE nspname = %s", (schema,)).fetchall() == [(fresh.owner,)]
        timeouts = conn.execute(
            "SELECT s.setconfig FROM pg_db_role_setting s JOIN pg_roles r"
            " ON r.oid = s.setrole WHERE r.rolname = %s", (fresh.gateway,)).fetchone()
    assert timeouts is not None and "statement_timeout=750ms" in timeouts[0]


BAD_LAYOUT_VALUES = [
    ("--schema", 'x"; DROP SCHEMA public; --'),
    ("--schema", "Upper"),
    ("--owner-role", "o'; DROP ROLE postgres; --"),
    ("--gateway-role", "g w"),
]


@pytest.mark.parametrize(("flag", "value"), BAD_LAYOUT_VALUES)
def test_roles_and_setup_refuse_bad_names_before_connecting(
        flag: str, value: str, fresh: Fresh, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("roles", "setup"):
        with pytest.raises(SystemExit) as exit_info:
            run(command, "--dsn", fresh.dsn, *fresh.layout(), flag, value)
        assert exit_info.value.code == 2
        assert "plain lower-case SQL identifier" in capsys.readouterr().err
    for flag_, duration in (("--statement-timeout", "5s'; DROP"),
                            ("--lock-timeout", "forever")):
        assert run("roles", "--dsn", fresh.dsn, *fresh.layout(), flag_, duration) == 1
        assert "must be a duration" in capsys.readouterr().err
        assert run("roles", "--print", flag_, duration) == 1
    with psycopg.connect(fresh.dsn) as conn:
        made = conn.execute("SELECT count(*) FROM pg_roles WHERE rolname IN (%s, %s)",
                            (fresh.owner, fresh.gateway)).fetchone()
    assert made == (0,)  # nothing was written


def test_roles_needs_a_dsn_unless_printing(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("MOS_LEASE_DSN", raising=False)
    assert run("roles") == 1
    assert "--dsn" in capsys.readouterr().err
    nowhere = "host=127.0.0.1 port=1 dbname=x user=x connect_timeout=2"
    for argv in (("roles", "--dsn", nowhere), ("setup", "--dsn", nowhere)):
        assert run(*argv) == 1
        assert capsys.readouterr().err.startswith("mos-lease: cannot connect")


def test_setup_by_a_role_without_rights_writes_nothing(
        fresh: Fresh, capsys: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(fresh.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(fresh.gateway)))
    # An ordinary role (here: what would become the gateway) tries to set the database up.
    assert run("setup", "--dsn", fresh.as_gateway(), *fresh.layout()) == 1
    assert "permission denied to create role" in capsys.readouterr().err
    with psycopg.connect(fresh.dsn) as conn:
        left = conn.execute(
            "SELECT (SELECT count(*) FROM pg_roles WHERE rolname = %s),"
            " (SELECT count(*) FROM pg_namespace WHERE nspname = 'mos_lease')",
            (fresh.owner,)).fetchone()
    assert left == (0, 0)  # the role step is one transaction: none of it was kept
