"""``mos-lease check`` through a real PgBouncer in transaction mode (``tests/pgbouncer.py``):
the pooler is detected and its settings named, a problem until the operator says the
gateways are built for it (``--behind-pooler``), and the same layout checked on the server
directly is fine."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from mos_lease_pg.admin import roles
from mos_lease_pg.admin.check import Status, run_check
from mos_lease_pg.translate import POOLER_SETTINGS
from tests.pg.test_pg_check import items
from tests.pg.test_pg_cli import Fresh, fresh_database
from tests.pg_fixtures import run_cli as run
from tests.pg_support import PgServer
from tests.pgbouncer import PgBouncer

pytestmark = pytest.mark.pg


@pytest.fixture
def ready(pg_server: PgServer) -> Iterator[Fresh]:
    with fresh_database(pg_server) as made:
        roles.set_up(made.dsn, owner_role=made.owner, gateway_role=made.gateway)
        yield made


def test_check_detects_pgbouncer_and_names_the_settings(
        ready: Fresh, pgbouncer: PgBouncer, capsys: pytest.CaptureFixture[str]) -> None:
    pooled = pgbouncer.dsn(ready.as_gateway())
    report, code = run_check(pooled)
    assert code == 1
    assert [i.name for i in report.problems] == ["pooler"]
    pooler = items(report)["pooler"]
    assert "the connection's startup named backend pid" in pooler.value, pooler.value
    assert f"connected to port {pgbouncer.port}, the server listens on" in pooler.value
    assert POOLER_SETTINGS in str(pooler.fix) and "--behind-pooler" in str(pooler.fix)
    # The rest is read through the pooler as on the server itself.
    assert items(report)["privileges"].status is Status.OK

    assert run("check", "--dsn", pooled, "--json") == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] is False and printed["exit_code"] == 1
    [item] = [i for i in printed["items"] if i["name"] == "pooler"]
    assert item["status"] == "problem" and POOLER_SETTINGS in item["fix"]
    assert run("check", "--dsn", pooled) == 1
    text = capsys.readouterr().out
    assert text.splitlines()[-1] == "1 problem(s)" and POOLER_SETTINGS in text

    # The same layout on the server directly: no pooler, nothing wrong.
    direct, code = run_check(ready.as_gateway())
    assert code == 0 and items(direct)["pooler"].status is Status.OK


def test_behind_pooler_acknowledges_it_and_requires_role_timeouts(
        ready: Fresh, pgbouncer: PgBouncer, capsys: pytest.CaptureFixture[str]) -> None:
    # The gateway role has the timeouts the roles step sets: a warning naming the settings.
    assert run("check", "--dsn", pgbouncer.dsn(ready.as_gateway()), "--behind-pooler",
               "--json") == 0
    [item] = [i for i in json.loads(capsys.readouterr().out)["items"]
              if i["name"] == "pooler"]
    assert item["status"] == "warn" and POOLER_SETTINGS in item["fix"]
    assert "statement_timeout=5s" in item["value"] and "lock_timeout=2s" in item["value"]
    # The superuser has none: behind a pooler nothing would bound its statements.
    report, code = run_check(pgbouncer.dsn(ready.dsn), behind_pooler=True)
    assert code == 1
    pooler = items(report)["pooler"]
    assert pooler.status is Status.PROBLEM
    assert "no role default statement_timeout or lock_timeout" in pooler.value
