"""``migrate``, ``status`` and ``audit`` as registered on an argparse parser."""

from __future__ import annotations

import argparse
import json

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease_pg import available_migrations
from mos_lease_pg.cli import register
from tests.pg_fixtures import PgSchema, StoreFactory

pytestmark = pytest.mark.pg


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mos-lease")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture
def history(pg_stores: StoreFactory, pg_tenant: str) -> str:
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    first = gateway.acquire(LeaseIdentity(pg_tenant, "agent", "b1"), "c1", scopes=["tool:run"],
                            ttl=60)
    assert first.lease is not None
    assert not gateway.acquire(LeaseIdentity(pg_tenant, "agent", "b1"), "c2", scopes=[],
                               ttl=60).ok
    assert gateway.takeover(LeaseIdentity(pg_tenant, "agent", "b1"), "c2", scopes=[], ttl=60,
                            expected_epoch=1).ok
    assert gateway.acquire(LeaseIdentity(pg_tenant, "agent", "b2"), "c3", scopes=[], ttl=60).ok
    return pg_tenant


def test_status_json(pg_dsn: str, history: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("status", "--dsn", pg_dsn, "--tenant", history, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert [(lease["binding_id"], lease["connector_id"], lease["epoch"], lease["state"])
            for lease in report["leases"]] == [("b1", "c2", 2, "active"), ("b2", "c3", 1, "active")]
    assert report["now"] and report["leases"][0]["scopes"] == []
    assert "lease_id" not in report["leases"][0]


def test_status_text(pg_dsn: str, history: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("status", "--dsn", pg_dsn, "--tenant", history) == 0
    out = capsys.readouterr().out
    assert "2 lease(s)" in out
    lines = out.splitlines()
    assert lines[1].split() == ["TENANT", "AGENT", "BINDING", "CONNECTOR", "EPOCH", "STATE",
                                "EXPIRES"]
    assert lines[2].split()[:6] == [history, "agent", "b1", "c2", "2", "active"]


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
        f"applied migrations: {versions}", f"schema {pg_schema_dsn.schema} version: {latest}"]
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
