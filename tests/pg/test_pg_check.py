"""``mos-lease check``: every problem it reports is provoked on a real server where one can
be (missing schema, unmigrated, old version, missing and surplus privileges,
``synchronous_commit = off``, no role timeouts behind a pooler, a relay in front of the
server, a skewed host clock, no server at all); what a single test server cannot be (a
standby, an old PostgreSQL, synchronous replication) is judged from gathered facts. A real
PgBouncer in front of the server is in ``test_pg_pgbouncer_check.py``."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import attrs
import psycopg
import pytest
from psycopg import sql

from mos_lease_pg.admin import check, roles
from mos_lease_pg.admin.check import ClockReading, Facts, Item, Report, Status, evaluate, run_check
from mos_lease_pg.preflight import SchemaCheck, required_version
from mos_lease_pg.translate import POOLER_SETTINGS
from tests.pg.test_pg_cli import Fresh, fresh_database, gateway_works
from tests.pg_fixtures import run_cli as run
from tests.pg_support import FaultProxy, PgServer, with_params

pytestmark = pytest.mark.pg

NAMES = ["connection", "server_version", "schema", "privileges", "synchronous_commit",
         "synchronous_standby_names", "standby", "clock_offset", "pooler"]


@pytest.fixture
def fresh(pg_server: PgServer) -> Iterator[Fresh]:
    with fresh_database(pg_server) as made:
        yield made


@pytest.fixture
def ready(fresh: Fresh) -> Iterator[Fresh]:
    roles.set_up(fresh.dsn, owner_role=fresh.owner, gateway_role=fresh.gateway)
    yield fresh


def _admin(layout: Fresh, statement: sql.Composed | str) -> None:
    with psycopg.connect(layout.dsn, autocommit=True) as conn:
        conn.execute(statement if isinstance(statement, sql.Composed) else statement.encode())


def items(report: Report) -> dict[str, Item]:
    return {item.name: item for item in report.items}


def test_the_gateway_after_setup_has_no_problem(ready: Fresh,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    report, code = run_check(ready.as_gateway())
    assert code == 0 and report.exit_code == 0
    assert [i.name for i in report.items] == NAMES
    found = items(report)
    assert found["schema"].status is Status.OK
    assert found["schema"].value == f"mos_lease at version {required_version()} " \
                                    f"(needs {required_version()})"
    assert found["privileges"] == Item(
        "privileges", f"role {ready.gateway}: exactly what the store needs", Status.OK)
    assert found["standby"].status is Status.OK and found["pooler"].status is Status.OK
    assert all(i.fix is not None for i in report.items if i.status is not Status.OK)
    # The command: one JSON object, the same items, exit 0.
    assert run("check", "--dsn", ready.as_gateway(), "--json") == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] is True and printed["exit_code"] == 0
    assert printed["schema"] == "mos_lease"
    assert [i["name"] for i in printed["items"]] == NAMES
    assert {i["status"] for i in printed["items"]} <= {"ok", "warn", "problem"}
    assert run("check", "--dsn", ready.as_gateway()) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[-1] == "no problems"
    assert text[0].split()[:2] == ["ok", "connection"]


def _problem(report: Report, name: str) -> Item:
    assert report.exit_code == 1
    found = items(report)[name]
    assert found.status is Status.PROBLEM, found
    assert found.fix
    assert [i.name for i in report.problems] == [name]
    return found


def test_a_missing_schema_is_a_problem_with_the_setup_fix(fresh: Fresh) -> None:
    report, code = run_check(fresh.dsn)
    assert code == 1
    schema = _problem(report, "schema")
    assert "schema 'mos_lease' does not exist" in schema.value
    assert schema.fix is not None and "mos-lease setup" in schema.fix
    assert items(report)["privileges"].status is Status.WARN  # not judged before the schema


def test_an_unmigrated_schema_is_a_problem(fresh: Fresh) -> None:
    roles.run_roles(fresh.dsn, owner_role=fresh.owner, gateway_role=fresh.gateway)
    schema = _problem(run_check(fresh.as_gateway())[0], "schema")
    assert "has no" in schema.value and "mos-lease migrate" in str(schema.fix)


def test_an_old_schema_version_is_a_problem_and_a_newer_one_a_warning(ready: Fresh) -> None:
    _admin(ready, "COMMENT ON TABLE mos_lease.mos_lease_schema_migrations IS "
                  "'mos-lease schema version 1'")
    schema = _problem(run_check(ready.as_gateway())[0], "schema")
    assert f"is at version 1, this mos-lease needs {required_version()}" in schema.value
    _admin(ready, "COMMENT ON TABLE mos_lease.mos_lease_schema_migrations IS "
                  "'mos-lease schema version 999'")
    report, code = run_check(ready.as_gateway())
    assert code == 0
    assert items(report)["schema"].status is Status.WARN
    assert items(report)["schema"].value.startswith("mos_lease at version 999")


def test_a_missing_privilege_is_a_problem_that_the_roles_step_fixes(ready: Fresh) -> None:
    _admin(ready, sql.SQL("REVOKE INSERT ON mos_lease.connector_lease_audit_log FROM {}")
           .format(sql.Identifier(ready.gateway)))
    report, code = run_check(ready.as_gateway())
    assert code == 1
    privileges = _problem(report, "privileges")
    assert "lacks INSERT on connector_lease_audit_log" in privileges.value
    assert privileges.fix is not None and "mos-lease roles" in privileges.fix
    assert f"--gateway-role {ready.gateway}" in privileges.fix
    assert items(report)["schema"].status is Status.OK
    # Doing what the fix says clears it.
    roles.run_roles(ready.dsn, owner_role=ready.owner, gateway_role=ready.gateway)
    assert run_check(ready.as_gateway())[1] == 0
    gateway_works(ready.as_gateway())


def test_no_usage_of_the_schema_is_a_privilege_problem(ready: Fresh) -> None:
    _admin(ready, sql.SQL("REVOKE USAGE ON SCHEMA mos_lease FROM {}")
           .format(sql.Identifier(ready.gateway)))
    privileges = _problem(run_check(ready.as_gateway())[0], "privileges")
    assert "may not use schema 'mos_lease'" in privileges.value


def test_surplus_privileges_are_a_warning(ready: Fresh) -> None:
    _admin(ready, sql.SQL("GRANT DELETE ON mos_lease.logical_agent_connector_leases TO {}")
           .format(sql.Identifier(ready.gateway)))
    report, code = run_check(ready.as_gateway())
    assert code == 0
    privileges = items(report)["privileges"]
    assert privileges.status is Status.WARN
    assert "surplus: DELETE on logical_agent_connector_leases" in privileges.value
    # A superuser holds everything: warned, named.
    superuser = items(run_check(ready.dsn)[0])["privileges"]
    assert superuser.status is Status.WARN and "superuser" in superuser.value


def test_synchronous_commit_off_for_the_role_is_a_problem(ready: Fresh) -> None:
    database = psycopg.conninfo.conninfo_to_dict(ready.dsn)["dbname"]
    _admin(ready, sql.SQL("ALTER ROLE {} IN DATABASE {} SET synchronous_commit = off")
           .format(sql.Identifier(ready.gateway), sql.Identifier(str(database))))
    item = _problem(run_check(ready.as_gateway())[0], "synchronous_commit")
    assert item.value == "off" and "synchronous_commit = on" in str(item.fix)


def test_behind_a_pooler_the_settings_are_named_and_role_timeouts_required(
        ready: Fresh) -> None:
    report, code = run_check(ready.as_gateway(), behind_pooler=True)
    assert code == 0  # the role step set the gateway's timeouts
    pooler = items(report)["pooler"]
    assert pooler.status is Status.WARN
    assert "statement_timeout=5s" in pooler.value and "lock_timeout=2s" in pooler.value
    assert POOLER_SETTINGS in str(pooler.fix)
    assert "session_options=False, prepare=False" in POOLER_SETTINGS
    # A role without them (the superuser here) cannot be protected behind a pooler.
    pooler = _problem(run_check(ready.dsn, behind_pooler=True)[0], "pooler")
    assert "no role default statement_timeout or lock_timeout" in pooler.value
    assert "mos-lease roles" in str(pooler.fix)


def test_a_relay_in_front_of_the_server_is_detected(ready: Fresh) -> None:
    proxy = FaultProxy(ready.as_gateway())
    try:
        report, code = run_check(with_params(proxy.dsn, user=ready.gateway))
    finally:
        proxy.close()
    assert code == 0
    pooler = items(report)["pooler"]
    assert pooler.status is Status.WARN
    assert f"connected to port {proxy.port}, the server listens on" in pooler.value
    assert POOLER_SETTINGS in str(pooler.fix)


def test_clock_offset_is_measured_with_its_uncertainty(ready: Fresh) -> None:
    same, _ = run_check(ready.as_gateway())
    value = items(same)["clock_offset"]
    assert value.status is Status.OK
    with psycopg.connect(ready.as_gateway(), autocommit=True) as conn:
        reading, pids = check.read_clock(conn)
        # Same machine, same clock: the true offset is zero, inside the reported bound
        # (plus the clocks' own resolution).
        assert abs(reading.offset) <= reading.uncertainty + 0.002
        skewed, _ = check.read_clock(conn, local_clock=lambda: time.time() + 30)
    assert len(set(pids)) == 1
    assert abs(skewed.offset + 30) <= skewed.uncertainty + 0.002
    report, code = run_check(ready.as_gateway(), local_clock=lambda: time.time() - 7)
    assert code == 0  # fencing never reads a gateway clock: a warning, not a problem
    offset = items(report)["clock_offset"]
    assert offset.status is Status.WARN
    # The value is printed to 0.1 ms with its bound: +7 s within it (not "+7.0" by text: a
    # loaded machine reads +6.9991 s, which is right within +- 0.0012 s).
    shown = re.fullmatch(r"database clock ([+-][0-9.]+) s from this host's "
                         r"\(\+- ([0-9.]+) s\)", offset.value)
    assert shown is not None, offset.value
    assert abs(float(shown.group(1)) - 7) <= float(shown.group(2)) + 0.002


def test_no_server_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    nowhere = "host=127.0.0.1 port=1 dbname=x user=x connect_timeout=2"
    report, code = run_check(nowhere)
    assert code == 2
    assert [(i.name, i.status) for i in report.items] == [("connection", Status.PROBLEM)]
    assert run("check", "--dsn", nowhere, "--json") == 2
    printed = json.loads(capsys.readouterr().out)
    assert printed["exit_code"] == 2 and printed["ok"] is False
    assert printed["items"][0]["value"].startswith("cannot connect")


# --- evaluation of gathered facts (what one test server cannot be) -------------------------


HEALTHY = Facts(
    schema="mos_lease", server_version_num=150004, server_version="15.4", role="gw",
    database="app", schema_check=SchemaCheck("mos_lease", required_version(), "gw", ()),
    schema_error=None, synchronous_commit="on", synchronous_standby_names="standby_a",
    in_recovery=False, statement_timeout="5s", lock_timeout="2s",
    clock=ClockReading(0.0001, 0.0002), client_port=5432, server_port=5432,
    backend_pids=(11, 11, 11))


def status_of(facts: Facts, name: str, **options: bool) -> Item:
    return items(evaluate(facts, **options))[name]


def test_healthy_facts_are_all_ok() -> None:
    report = evaluate(HEALTHY)
    assert [(i.name, i.status) for i in report.items] == [(n, Status.OK) for n in NAMES]
    assert report.exit_code == 0


def test_a_standby_is_a_problem() -> None:
    item = status_of(attrs.evolve(HEALTHY, in_recovery=True), "standby")
    assert item.status is Status.PROBLEM and "target_session_attrs=read-write" in str(item.fix)
    assert evaluate(attrs.evolve(HEALTHY, in_recovery=True)).exit_code == 1


def test_durability_settings() -> None:
    assert status_of(attrs.evolve(HEALTHY, synchronous_commit="off"),
                     "synchronous_commit").status is Status.PROBLEM
    assert status_of(attrs.evolve(HEALTHY, synchronous_commit="local"),
                     "synchronous_commit").status is Status.WARN
    alone = attrs.evolve(HEALTHY, synchronous_commit="local", synchronous_standby_names="")
    assert status_of(alone, "synchronous_commit").status is Status.OK
    assert status_of(alone, "synchronous_standby_names").status is Status.WARN
    for fine in ("on", "remote_apply", "remote_write"):
        assert status_of(attrs.evolve(HEALTHY, synchronous_commit=fine),
                         "synchronous_commit").status is Status.OK


def test_an_old_server_is_a_problem() -> None:
    item = status_of(attrs.evolve(HEALTHY, server_version_num=110022, server_version="11.22"),
                     "server_version")
    assert item.status is Status.PROBLEM and "12 or newer" in str(item.fix)


def test_a_transaction_pooler_is_seen_when_backends_change() -> None:
    pooled = attrs.evolve(HEALTHY, backend_pids=(11, 12, 11))
    # Seen for certain and not acknowledged: a problem (default stores are refused there).
    item = status_of(pooled, "pooler")
    assert item.status is Status.PROBLEM and "2 backends answered 3 transactions" in item.value
    assert POOLER_SETTINGS in str(item.fix) and "--behind-pooler" in str(item.fix)
    item = status_of(pooled, "pooler", behind_pooler=True)
    assert item.status is Status.WARN and POOLER_SETTINGS in str(item.fix)
    bare = attrs.evolve(pooled, statement_timeout="0")
    assert status_of(bare, "pooler", behind_pooler=True).status is Status.PROBLEM
    # Without any sign and without the flag, role timeouts are not required.
    assert status_of(attrs.evolve(HEALTHY, statement_timeout="0"),
                     "pooler").status is Status.OK
    assert status_of(HEALTHY, "pooler", behind_pooler=True).status is Status.WARN


def test_a_pooler_is_seen_when_the_startup_names_another_backend() -> None:
    assert status_of(attrs.evolve(HEALTHY, startup_pid=11), "pooler").status is Status.OK
    pooled = attrs.evolve(HEALTHY, startup_pid=-806798535)
    item = status_of(pooled, "pooler")
    assert item.status is Status.PROBLEM
    assert item.value == ("the connection's startup named backend pid -806798535, backend "
                          "11 answered (a pooler answers the startup itself)")
    assert status_of(pooled, "pooler", behind_pooler=True).status is Status.WARN
    # A different port alone (a relay, a port mapping) stays a warning.
    relayed = attrs.evolve(HEALTHY, startup_pid=11, client_port=6432)
    assert status_of(relayed, "pooler").status is Status.WARN


def test_a_clock_offset_within_its_uncertainty_is_not_warned() -> None:
    assert status_of(attrs.evolve(HEALTHY, clock=ClockReading(1.5, 0.6)),
                     "clock_offset").status is Status.OK
    assert status_of(attrs.evolve(HEALTHY, clock=ClockReading(-1.5, 0.4)),
                     "clock_offset").status is Status.WARN
