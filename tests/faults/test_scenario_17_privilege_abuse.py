"""Scenario 17: privilege abuse as the gateway role -> 0 of at least 25 rewrites succeed.

The least-privilege layout (``mos_lease_pg/sql/roles.sql``) is built with roles of unique
names in a schema of its own. A gateway holds one active lease and one released lease and
has raised a resource's high-water mark to epoch 2. Then, connected as the gateway role (a
stolen gateway credential), every way to rewrite fencing state is tried, each in its own
transaction: each column of the lease table (identity, epoch down / to the bigint maximum
/ + 2 / + 1 alone, a new lease UUID without an epoch, infinite, far, backwards and future
times, a cleared release, NULLs, illegal inserts), the audit log (UPDATE, DELETE, bad
vocabulary), the resource epochs (lowering, identity, DELETE, an upsert that lowers), the
settings row, and the schema itself (ALTER TABLE, DISABLE / DROP TRIGGER, CREATE OR REPLACE
FUNCTION of the checking function, COPY FROM, TRUNCATE, SET ROLE to the owner,
session_replication_role, creating tables, functions, triggers and rules, granting oneself
more). None may succeed, and every table must read the same before and after. The
rewritten resource mark's repro closes the run: a stale token (epoch 1) is presented to the
resource guard and must be refused. Positive control: the same connection's legal writes
(a heartbeat through the library, raising the resource mark) succeed, which shows a success
would be seen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseHandle, LeaseIdentity
from mos_lease.errors import MosLeaseError
from mos_lease.token import FencingToken
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.fencing import PostgresResourceGuard
from tests.faults.support import Table
from tests.pg.test_pg_roles import Layout, role_layout

pytestmark = [pytest.mark.faults, pytest.mark.pg]

MAX_EPOCH = 2**63 - 1
ACTIVE = "tenant_id = 'abuse' AND binding_id = 'active'"
RELEASED = "tenant_id = 'abuse' AND binding_id = 'released'"
LEASES = "logical_agent_connector_leases"
NOW = "WITH t AS (SELECT clock_timestamp() AS now) "
ROTATED = ("lease_id = gen_random_uuid(), acquired_at = t.now, heartbeat_at = t.now, "
           "expires_at = t.now + interval '1 minute', updated_at = t.now")
INSERTED = (f"INSERT INTO {LEASES} SELECT 'abuse', 'a', 'new', gen_random_uuid(), 'c', "
            "'{}', %s FROM t")

ATTACKS: list[tuple[str, str]] = [
    # --- the lease table, column by column --------------------------------------------------
    ("tenant_id moved", f"UPDATE {LEASES} SET tenant_id = 'other' WHERE {ACTIVE}"),
    ("logical_agent_id moved", f"UPDATE {LEASES} SET logical_agent_id = 'x' WHERE {ACTIVE}"),
    ("binding_id moved", f"UPDATE {LEASES} SET binding_id = 'x' WHERE {ACTIVE}"),
    ("lease_id changed without the epoch",
     f"UPDATE {LEASES} SET lease_id = gen_random_uuid() WHERE {ACTIVE}"),
    ("connector_id taken over in place", f"UPDATE {LEASES} SET connector_id = 'thief'"
     f" WHERE {ACTIVE}"),
    ("allowed_scopes widened", f"UPDATE {LEASES} SET allowed_scopes = ARRAY['admin:*']"
     f" WHERE {ACTIVE}"),
    ("epoch lowered", f"UPDATE {LEASES} SET epoch = epoch - 1 WHERE {ACTIVE}"),
    ("epoch to the bigint maximum", f"UPDATE {LEASES} SET epoch = {MAX_EPOCH} WHERE {ACTIVE}"),
    ("epoch + 1 alone", f"UPDATE {LEASES} SET epoch = epoch + 1 WHERE {ACTIVE}"),
    ("epoch + 2 with a new lease UUID",
     NOW + f"UPDATE {LEASES} SET epoch = epoch + 2, {ROTATED} FROM t WHERE {ACTIVE}"),
    ("epoch NULL", f"UPDATE {LEASES} SET epoch = NULL WHERE {ACTIVE}"),
    ("acquired_at changed on a renewal", NOW + f"UPDATE {LEASES} SET acquired_at = t.now,"
     " heartbeat_at = t.now, updated_at = t.now FROM t WHERE " + ACTIVE),
    ("heartbeat_at an hour ahead", "WITH t AS (SELECT clock_timestamp() + interval '1 hour'"
     f" AS now) UPDATE {LEASES} SET heartbeat_at = t.now, expires_at = t.now + interval"
     f" '1 minute', updated_at = t.now FROM t WHERE {ACTIVE}"),
    ("heartbeat_at NULL", f"UPDATE {LEASES} SET heartbeat_at = NULL WHERE {ACTIVE}"),
    ("expires_at infinity", f"UPDATE {LEASES} SET expires_at = 'infinity' WHERE {ACTIVE}"),
    ("expires_at a year ahead", NOW + f"UPDATE {LEASES} SET heartbeat_at = t.now,"
     " expires_at = t.now + interval '1 year', updated_at = t.now FROM t WHERE " + ACTIVE),
    ("expires_at before heartbeat_at", f"UPDATE {LEASES} SET expires_at = heartbeat_at"
     f" - interval '1 second' WHERE {ACTIVE}"),
    ("updated_at infinity", f"UPDATE {LEASES} SET updated_at = 'infinity' WHERE {ACTIVE}"),
    ("released_at infinity", f"UPDATE {LEASES} SET released_at = 'infinity',"
     f" updated_at = 'infinity' WHERE {ACTIVE}"),
    ("released_at cleared (a released lease revived)", NOW + f"UPDATE {LEASES} SET"
     " released_at = NULL, heartbeat_at = t.now, expires_at = t.now + interval '1 minute',"
     f" updated_at = t.now FROM t WHERE {RELEASED}"),
    ("takeover without a new lease UUID", NOW + f"UPDATE {LEASES} SET epoch = epoch + 1,"
     " acquired_at = t.now, heartbeat_at = t.now, expires_at = t.now + interval '1 minute',"
     f" released_at = NULL, updated_at = t.now FROM t WHERE {RELEASED}"),
    ("insert at epoch 9", NOW + INSERTED % "9, t.now, t.now, t.now + interval '1 minute', "
     "NULL, t.now"),
    ("insert expiring in a year", NOW + INSERTED % "1, t.now, t.now, t.now + interval "
     "'1 year', NULL, t.now"),
    ("insert stamped at -infinity", NOW + INSERTED % "1, '-infinity', '-infinity', "
     "'-infinity', NULL, '-infinity'"),
    ("DELETE a lease row", f"DELETE FROM {LEASES} WHERE {RELEASED}"),
    ("TRUNCATE the lease table", f"TRUNCATE {LEASES}"),
    # --- the audit log ----------------------------------------------------------------------
    ("audit row rewritten", "UPDATE connector_lease_audit_log SET outcome = 'denied',"
     " reason = 'policy_denied'"),
    ("audit rows deleted", "DELETE FROM connector_lease_audit_log"),
    ("TRUNCATE the audit log", "TRUNCATE connector_lease_audit_log"),
    ("audit insert with bad vocabulary", "INSERT INTO connector_lease_audit_log (event_id,"
     " event, outcome, reason, tenant_id, logical_agent_id, binding_id, connector_id, epoch,"
     " correlation_id, recorded_at) VALUES (gen_random_uuid(), 'DROP TABLE x', 'ok', NULL,"
     " 'abuse', 'a', 'active', 'c', 1, 'x', now())"),
    ("audit insert: a reason on an acquisition", "INSERT INTO connector_lease_audit_log"
     " (event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id,"
     " connector_id, epoch, correlation_id, recorded_at) VALUES (gen_random_uuid(), 'acquire',"
     " 'acquired', 'lease_held', 'abuse', 'a', 'active', 'c', 1, 'x', now())"),
    # --- resource high-water marks ------------------------------------------------------------
    ("resource mark lowered (a stale token admitted)",
     "UPDATE connector_resource_epochs SET highest_epoch = 1"),
    ("resource mark lowered by an upsert", "INSERT INTO connector_resource_epochs VALUES"
     " ('res', 'abuse', 'a', 'active', 1, now()) ON CONFLICT (resource_id) DO UPDATE"
     " SET highest_epoch = 1"),
    ("resource renamed", "UPDATE connector_resource_epochs SET resource_id = 'other'"),
    ("resource moved to another identity",
     "UPDATE connector_resource_epochs SET tenant_id = 'other'"),
    ("resource mark stamped infinity",
     "UPDATE connector_resource_epochs SET updated_at = 'infinity'"),
    ("DELETE a resource mark", "DELETE FROM connector_resource_epochs"),
    ("TRUNCATE the resource marks", "TRUNCATE connector_resource_epochs"),
    # --- the clock allowance --------------------------------------------------------------------
    ("clock allowance raised", "UPDATE mos_lease_settings SET clock_allowance = '10 years'"),
    ("clock allowance row removed", "DELETE FROM mos_lease_settings"),
    # --- the schema itself ----------------------------------------------------------------------
    ("ALTER TABLE ... DISABLE TRIGGER ALL", f"ALTER TABLE {LEASES} DISABLE TRIGGER ALL"),
    ("ALTER TABLE ... DISABLE TRIGGER (the check)",
     f"ALTER TABLE {LEASES} DISABLE TRIGGER logical_agent_connector_leases_fencing"),
    ("ALTER TABLE ... DISABLE TRIGGER (resource marks)", "ALTER TABLE"
     " connector_resource_epochs DISABLE TRIGGER connector_resource_epochs_fencing"),
    ("ALTER TABLE ... DROP CONSTRAINT",
     f"ALTER TABLE {LEASES} DROP CONSTRAINT logical_agent_connector_leases_epoch_check"),
    ("ALTER TABLE ... ALTER COLUMN epoch TYPE",
     f"ALTER TABLE {LEASES} ALTER COLUMN epoch TYPE numeric"),
    ("DROP TRIGGER", f"DROP TRIGGER logical_agent_connector_leases_fencing ON {LEASES}"),
    ("CREATE OR REPLACE FUNCTION (the check)", "CREATE OR REPLACE FUNCTION"
     " mos_lease_check_lease_write() RETURNS trigger LANGUAGE plpgsql AS"
     " 'BEGIN RETURN NEW; END'"),
    ("CREATE OR REPLACE FUNCTION (the refusal)", "CREATE OR REPLACE FUNCTION"
     " mos_lease_refuse() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END'"),
    ("ALTER FUNCTION ... SECURITY INVOKER",
     "ALTER FUNCTION mos_lease_check_lease_write() SECURITY INVOKER"),
    ("calling the check directly", "SELECT mos_lease_check_lease_write()"),
    ("SET ROLE to the owner", "SET ROLE {owner}"),
    ("SET session_replication_role = replica", "SET session_replication_role = replica"),
    ("CREATE TABLE in the schema", "CREATE TABLE {schema}.sneaky (x int)"),
    ("CREATE FUNCTION in the schema", "CREATE FUNCTION {schema}.sneaky() RETURNS int"
     " LANGUAGE sql AS 'SELECT 1'"),
    ("CREATE TRIGGER on the lease table", f"CREATE TRIGGER sneaky BEFORE UPDATE ON {LEASES}"
     " FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()"),
    ("CREATE RULE on the lease table", f"CREATE RULE sneaky AS ON UPDATE TO {LEASES}"
     " DO INSTEAD NOTHING"),
    # (GRANT ALL ON a table TO oneself only warns "no privileges were granted".)
    ("GRANT oneself the owner role", "GRANT {owner} TO CURRENT_USER"),
    ("ALTER TABLE ... OWNER TO oneself", f"ALTER TABLE {LEASES} OWNER TO CURRENT_USER"),
    ("ALTER ROLE oneself SUPERUSER", "ALTER ROLE CURRENT_USER SUPERUSER"),
    ("COPY ... FROM a server file", f"COPY {LEASES} FROM '/etc/hostname'"),
]
COPY_ROWS = {
    "COPY ... FROM STDIN (a row at epoch 9)": ("abuse", "a", "copied", 9),
    "COPY ... FROM STDIN (a row expiring in a year)": ("abuse", "a", "copied", 1),
}


@pytest.fixture
def layout(pg_dsn: str, admin: psycopg.Connection[Any]) -> Iterator[Layout]:
    with role_layout(pg_dsn, admin) as built:
        yield built


def _snapshot(owner: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """Every row of every mos-lease table, read as the owner (a table the schema lacks, as
    before migration 0002, reads as None)."""
    tables = (LEASES, "connector_lease_audit_log", "connector_resource_epochs",
              "mos_lease_settings")
    return tuple(owner.execute(f"SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY"
                               f" x::text), '')), count(*) FROM {table} AS x").fetchone()
                 if owner.execute("SELECT to_regclass(%s)", (table,)).fetchone() != (None,)
                 else None for table in tables)


def _attempt(conn: psycopg.Connection[Any], statement: str) -> str:
    """Run one statement in its own transaction; what happened, as a short text."""
    try:
        with conn.transaction():
            conn.execute(statement.encode())
    except psycopg.Error as exc:
        return f"refused {exc.sqlstate}: {str(exc).splitlines()[0][:70]}"
    return "SUCCEEDED"


def _copy(conn: psycopg.Connection[Any], row: tuple[str, str, str, int], far: bool) -> str:
    try:
        with conn.transaction(), conn.cursor() as cur:
            now = conn.execute("SELECT clock_timestamp()").fetchone()
            assert now is not None
            expires = "infinity" if far else now[0].isoformat()
            with cur.copy(f"COPY {LEASES} FROM STDIN".encode()) as copy:
                copy.write_row((*row[:3], "00000000-0000-4000-8000-000000000001", "c", "{}",
                                row[3], now[0], now[0], expires, None, now[0]))
    except psycopg.Error as exc:
        return f"refused {exc.sqlstate}: {str(exc).splitlines()[0][:70]}"
    return "SUCCEEDED"


def _setup(gateway: ConnectorLeaseCoordinator) -> tuple[LeaseHandle, FencingToken]:
    """An active lease, a released one, and a resource mark at epoch 2 (a stale token at
    epoch 1 is kept for the end)."""
    active = LeaseIdentity("abuse", "a", "active")
    first = gateway.acquire(active, "c1", scopes=["tool:run"], ttl=120).lease
    assert first is not None
    stale = FencingToken(active, "c1", first.lease_id, 1, first.expires_at)
    second = gateway.takeover(active, "c2", scopes=["tool:run"], ttl=120, expected_epoch=1)
    assert second.lease is not None
    released = gateway.acquire(LeaseIdentity("abuse", "a", "released"), "c1", scopes=[],
                               ttl=120).lease
    assert released is not None and gateway.release(released).ok
    return second.lease, stale


def _renewed(gateway: ConnectorLeaseCoordinator, holder: LeaseHandle) -> bool | str:
    """The holder's heartbeat; a rewrite that got through can make it fail (an 'infinity'
    expiry fails every read), which is a finding to report, not a crash of the scenario."""
    try:
        return gateway.heartbeat(holder, ttl=120).ok
    except MosLeaseError as exc:
        return f"{type(exc).__name__}: {str(exc)[:60]}"


def test_privilege_abuse(layout: Layout, figures: Table) -> None:
    with PostgresLeaseStore(layout.gateway_dsn,
                            settings=ConnectionSettings(schema=layout.schema)) as store, \
            psycopg.connect(layout.gateway_dsn, autocommit=True) as conn, \
            psycopg.connect(layout.owner_dsn, autocommit=True) as owner:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        holder, stale = _setup(gateway)
        guard = PostgresResourceGuard(conn, schema=layout.schema)
        current = FencingToken(holder.identity, holder.connector_id, holder.lease_id,
                               holder.epoch, holder.expires_at)
        assert guard.admit("res", current).ok
        before = _snapshot(owner)
        outcomes = [(name, _attempt(conn, statement.replace("{owner}", layout.owner)
                                    .replace("{schema}", layout.schema)))
                    for name, statement in ATTACKS]
        outcomes += [(name, _copy(conn, row, far="year" in name))
                     for name, row in COPY_ROWS.items()]
        after = _snapshot(owner)
        stale_admitted = guard.admit("res", stale).ok
        # Positive control: the same credentials' legal writes go through.
        renewed = _renewed(gateway, holder)
        raised = _attempt(conn, "UPDATE connector_resource_epochs SET highest_epoch = 3")

    succeeded = [name for name, what in outcomes if what == "SUCCEEDED"]
    states = Counter(what.split(":")[0] for _, what in outcomes)
    figures.add("rewrites tried as the gateway role", len(outcomes), ">= 25",
                len(outcomes) >= 25)
    figures.add("succeeded", len(succeeded), "0", not succeeded)
    figures.add("refusals by SQLSTATE", dict(states.most_common()))
    figures.add("tables (leases, audit, resource marks, settings) before / after",
                "unchanged" if before == after else "CHANGED", "unchanged", before == after)
    figures.add("stale token (epoch 1) admitted after the attack", stale_admitted, "False",
                not stale_admitted)
    figures.add("positive control: legal heartbeat and mark raise as the gateway",
                f"{renewed} / {raised}", "True / SUCCEEDED",
                renewed is True and raised == "SUCCEEDED")
    figures.notes += [f"{name} -> {what}" for name, what in outcomes]
    print(f"\nscenario 17: {len(outcomes)} rewrites as the gateway role, "
          f"{len(succeeded)} succeeded", flush=True)
    assert not figures.failed(), figures.render()
