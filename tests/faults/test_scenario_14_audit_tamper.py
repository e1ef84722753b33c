"""Scenario 14: audit tampering as the gateway role -> 0 succeed; canaries -> 0 leak.

The least-privilege layout (``mos_lease_pg/sql/roles.sql``) is built with roles of unique
names in a schema of its own. Connected as the gateway role, every way to change or remove
audit history is tried (UPDATE, DELETE, TRUNCATE, disabling or dropping the triggers,
dropping or renaming the table, upserting over a row, turning triggers off for the session,
lowering an epoch, deleting lease rows); as the owner role the same UPDATE/DELETE/TRUNCATE
must meet the triggers. None may succeed, and the audit log must hash the same before and
after.

Then a gateway works with canary secrets planted in scopes (granted and refused ones), in
adapter requests, results and exceptions, and in the fencing token it propagates. No canary
may appear in the audit log, in anything the library logged (every logger, DEBUG and up,
exceptions included) or in the server log. A canary in the correlation id is the positive
control: the seed requires the audit log to store the correlation id, so it must be found
there, in that column only, which shows the search can find a canary at all.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease import (
    AllowAllPolicy,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    StaticConnectorPolicy,
)
from mos_lease.adapter import run_adapter
from mos_lease.token import format_token
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.admin import apply_roles, migrate
from tests.faults.support import Table
from tests.pg_support import unique_name, with_params

pytestmark = [pytest.mark.faults, pytest.mark.pg]

SERVER_LOG = Path("/var/log/postgresql/postgresql-15-main.log")


@pytest.fixture
def layout(pg_dsn: str, admin: psycopg.Connection[Any]) -> Iterator[dict[str, str]]:
    """Owner and gateway roles (unique names: roles are cluster-wide) and their schema,
    migrated as the owner; all dropped afterwards."""
    names = {"owner_role": unique_name("faults_owner"),
             "gateway_role": unique_name("faults_gateway"),
             "schema_name": unique_name("faults_audit")}
    try:
        apply_roles(admin, **names)
        owner_dsn = with_params(pg_dsn, user=names["owner_role"])
        migrate(owner_dsn, schema=names["schema_name"], allow_second_copy=True)
        apply_roles(admin, **names)  # again, to grant on the tables that now exist
        yield {**names, "owner_dsn": owner_dsn,
               "gateway_dsn": with_params(pg_dsn, user=names["gateway_role"])}
    finally:
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                      .format(sql.Identifier(names["schema_name"])))
        for role in (names["gateway_role"], names["owner_role"]):
            if admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s",
                             (role,)).fetchone() is not None:
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _audit_hash(conn: psycopg.Connection[Any]) -> tuple[int, str]:
    row = conn.execute("SELECT count(*), coalesce(md5(string_agg(a::text, ',' ORDER BY seq)), "
                       "'') FROM connector_lease_audit_log AS a").fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def _tamper(dsn: str, statements: list[str]) -> list[tuple[str, str]]:
    """Run each statement in its own transaction; returns (statement, what happened)."""
    out = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for text in statements:
            try:
                with conn.transaction():
                    conn.execute(text.encode())
                out.append((text, "SUCCEEDED"))
            except psycopg.Error as exc:
                out.append((text, f"refused ({exc.sqlstate}: "
                                  f"{str(exc).splitlines()[0][:60]})"))
    return out


GATEWAY_TAMPERING = [
    "UPDATE connector_lease_audit_log SET reason = 'lease_held'",
    "UPDATE connector_lease_audit_log SET outcome = 'denied', reason = 'policy_denied' "
    "WHERE outcome = 'taken_over'",
    "DELETE FROM connector_lease_audit_log",
    "DELETE FROM connector_lease_audit_log WHERE seq = (SELECT max(seq) FROM "
    "connector_lease_audit_log)",
    "TRUNCATE connector_lease_audit_log",
    "TRUNCATE connector_lease_audit_log, logical_agent_connector_leases CASCADE",
    "ALTER TABLE connector_lease_audit_log DISABLE TRIGGER ALL",
    "ALTER TABLE connector_lease_audit_log DISABLE TRIGGER connector_lease_audit_log_append_only",
    "DROP TRIGGER connector_lease_audit_log_append_only ON connector_lease_audit_log",
    "DROP TABLE connector_lease_audit_log",
    "ALTER TABLE connector_lease_audit_log RENAME TO old_audit",
    "INSERT INTO connector_lease_audit_log (event_id, event, outcome, reason, tenant_id, "
    "logical_agent_id, binding_id, connector_id, epoch, correlation_id, recorded_at) "
    "SELECT event_id, event, 'denied', 'policy_denied', tenant_id, logical_agent_id, "
    "binding_id, connector_id, epoch, correlation_id, recorded_at FROM "
    "connector_lease_audit_log ON CONFLICT (event_id) DO UPDATE SET outcome = 'denied'",
    "SET session_replication_role = replica",
    "CREATE RULE hide AS ON INSERT TO connector_lease_audit_log DO INSTEAD NOTHING",
    "SELECT setval(pg_get_serial_sequence('connector_lease_audit_log', 'seq'), 1)",
    "UPDATE logical_agent_connector_leases SET epoch = 1",
    "UPDATE logical_agent_connector_leases SET tenant_id = 'elsewhere'",
    "DELETE FROM logical_agent_connector_leases",
    "TRUNCATE logical_agent_connector_leases",
]
OWNER_TAMPERING = [
    "UPDATE connector_lease_audit_log SET reason = 'lease_held'",
    "DELETE FROM connector_lease_audit_log",
    "TRUNCATE connector_lease_audit_log",
    "UPDATE logical_agent_connector_leases SET epoch = 1",
    "DELETE FROM logical_agent_connector_leases",
]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(logging.Formatter("%(name)s %(message)s").format(record))


def _work_with_canaries(gateway_dsn: str, canary: dict[str, str],
                        capture: _Capture, schema: str) -> tuple[list[str], list[str]]:
    """A gateway's ordinary work with canaries planted everywhere a secret could ride along;
    every log record meanwhile goes to ``capture``. Returns the fencing tokens the adapter
    propagated and the adapter exceptions that reached the caller."""
    tokens: list[str] = []
    store = PostgresLeaseStore(gateway_dsn, settings=ConnectionSettings(schema=schema,
        application_name="faults-canary"))
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(capture)
    root.setLevel(logging.DEBUG)
    caught: list[str] = []
    try:
        identity = LeaseIdentity("canary-tenant", "agent", "b")
        scopes = ["tool:read", f"secret:{canary['scope']}"]
        got = coordinator.acquire(identity, "gw", scopes=scopes, ttl=60,
                                  correlation_id=f"corr-{canary['corr']}")
        assert got.lease is not None
        granted = coordinator.issue_grant(got.lease, scopes=scopes, ttl=20)
        assert granted.grant is not None
        refused = coordinator.issue_grant(got.lease, scopes=[f"x:{canary['refused_scope']}"],
                                          ttl=20)
        assert not refused.ok
        coordinator.validate(granted.grant, identity=identity,
                             scopes=[f"y:{canary['refused_scope']}"])
        strict = ConnectorLeaseCoordinator(store, StaticConnectorPolicy.from_dict({"rules": [{
            "tenant_id": "*", "logical_agent_id": "*", "binding_id": "*", "connector_id": "*",
            "scopes": ["tool:read"], "max_lease_ttl": 60, "max_grant_ttl": 10}]}))
        strict.acquire(LeaseIdentity("canary-tenant", "agent", "b2"), "gw",
                       scopes=[f"z:{canary['policy_scope']}"], ttl=30)

        class Adapter:
            """An adapter whose request and result carry secrets, as real ones do."""

            def execute(self, ctx: ConnectorExecutionContext, request: str) -> dict[str, str]:
                tokens.append(format_token(ctx))
                return {"payload": canary["result"], "echo": request}

        result = run_adapter(coordinator, granted.grant, Adapter(),
                             f"run --token {canary['request']}", identity=identity,
                             scopes=scopes)
        assert result.ok and result.value is not None

        def failing(ctx: ConnectorExecutionContext) -> None:
            raise RuntimeError(f"adapter failed with {canary['error']}")

        try:
            coordinator.invoke(granted.grant, failing, identity=identity, scopes=scopes)
        except RuntimeError as exc:
            caught.append(str(exc))
        coordinator.takeover(identity, "gw2", scopes=scopes, ttl=30,
                             expected_epoch=got.lease.epoch)
        coordinator.validate(granted.grant, identity=identity, scopes=scopes)  # stale
    finally:
        root.removeHandler(capture)
        root.setLevel(old_level)
        store.close()

    return tokens, caught


def test_audit_tampering_and_canaries(layout: dict[str, str], admin: psycopg.Connection[Any],
                                      figures: Table) -> None:
    gateway_dsn, owner_dsn = layout["gateway_dsn"], layout["owner_dsn"]
    canary = {kind: f"canary{secrets.token_hex(8)}" for kind in (
        "scope", "refused_scope", "policy_scope", "request", "result", "error", "corr")}
    log_size = SERVER_LOG.stat().st_size if os.access(SERVER_LOG, os.R_OK) else None
    capture = _Capture()
    tokens, caught = _work_with_canaries(gateway_dsn, canary, capture, layout["schema_name"])

    with psycopg.connect(owner_dsn, autocommit=True) as owner:
        before = _audit_hash(owner)
        audit_text = "\n".join(str(r) for r in owner.execute(
            "SELECT a::text FROM connector_lease_audit_log AS a").fetchall())
        corr_column = "\n".join(r[0] for r in owner.execute(
            "SELECT correlation_id FROM connector_lease_audit_log").fetchall())
    gateway_results = _tamper(gateway_dsn, GATEWAY_TAMPERING)
    owner_results = _tamper(owner_dsn, OWNER_TAMPERING)
    with psycopg.connect(owner_dsn, autocommit=True) as owner:
        after = _audit_hash(owner)
    # Not tampering but worth stating: the gateway role must INSERT audit rows, so a stolen
    # gateway credential can append a made-up row. Append-only is not tamper-evident.
    appended = _tamper(gateway_dsn, [
        "INSERT INTO connector_lease_audit_log (event_id, event, outcome, reason, tenant_id, "
        "logical_agent_id, binding_id, connector_id, epoch, correlation_id, recorded_at) "
        "VALUES (gen_random_uuid(), 'takeover', 'denied', 'policy_denied', 'canary-tenant', "
        "'agent', 'b', 'forged', 1, 'forged', now())"])[0][1]

    server_log = ""
    if log_size is not None:
        with SERVER_LOG.open("rb") as log:
            log.seek(log_size)
            server_log = log.read().decode("utf-8", "replace")
    logs = "\n".join(capture.text)
    token_text = "\n".join(tokens)
    secret = [k for k in canary if k != "corr"]
    in_audit = [k for k in secret if canary[k] in audit_text]
    in_logs = [k for k in canary if canary[k] in logs or canary[k] in server_log]
    in_tokens = [k for k in canary if canary[k] in token_text]
    corr_found = canary["corr"] in corr_column
    corr_elsewhere = audit_text.count(canary["corr"]) != corr_column.count(canary["corr"])
    succeeded = [t for t, what in gateway_results + owner_results if what == "SUCCEEDED"]

    figures.add("tampering statements as the gateway role", len(GATEWAY_TAMPERING))
    figures.add("tampering statements as the owner role (triggers)", len(OWNER_TAMPERING))
    figures.add("succeeded", len(succeeded), "0", not succeeded)
    figures.add("audit log before / after (rows, md5)", f"{before[0]}, {before[1][:8]} / "
                f"{after[0]}, {after[1][:8]}", "unchanged", before == after)
    figures.add("canaries planted", ", ".join(canary))
    figures.add("canaries found in the audit log (scopes, payloads, errors)", len(in_audit),
                "0", not in_audit)
    figures.add("canaries found in library logs or the server log", len(in_logs), "0",
                not in_logs)
    figures.add("canaries found in propagated fencing tokens", len(in_tokens), "0",
                not in_tokens)
    figures.add("log records captured / server log read", f"{len(capture.text)} / "
                f"{'yes' if log_size is not None else 'not readable here'}")
    figures.add("positive control: correlation-id canary in its audit column (by design)",
                corr_found and not corr_elsewhere, "True", corr_found and not corr_elsewhere)
    figures.add("adapter exception reached the caller", bool(caught), "True", bool(caught))
    figures.add("gateway role appending a made-up audit row (needs INSERT; see notes)",
                appended.split(" (")[0])
    for text, what in gateway_results:
        figures.notes.append(f"gateway: {text[:70]} -> {what}")
    for text, what in owner_results:
        figures.notes.append(f"owner: {text[:70]} -> {what}")
    figures.notes += [f"canary {k} found" for k in in_audit + in_logs + in_tokens]
    assert not figures.failed(), figures.render()
