"""The database permits only the library's transitions, for every role (migration 0002).

In a schema of its own, built with the least-privilege layout: every legal transition still
works as the gateway role (through the library, and as the library's statement shapes
written by hand), and every illegal shape of a lease-row or resource-epoch write is refused
to the gateway role and to the owner alike, leaving the row as it was. The clock bound:
a write stamped ahead of the database clock is refused until the owner raises the schema's
allowance, which the gateway role can neither read nor change. And the cost model: an
ordinary heartbeat passes the WHEN clause without calling the checking function.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.errors import StoreUnavailable
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from tests.pg.test_pg_roles import Layout, role_layout
from tests.pg_clock import ShiftedPostgresLeaseStore

pytestmark = pytest.mark.pg

MAX_EPOCH = 2**63 - 1
# The seeded row (tests/pg/test_pg_roles.py: _seed): tenant "seed", epoch 2, connector c2.
SEED = "tenant_id = 'seed'"


@pytest.fixture(scope="module")
def layout(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[Layout]:
    with role_layout(pg_dsn, pg_admin) as built:
        with psycopg.connect(built.owner_dsn, autocommit=True) as owner:
            owner.execute("INSERT INTO connector_resource_epochs VALUES"
                          " ('res', 'seed', 'a', 'b', 5, clock_timestamp())")
        yield built


def _rows(conn: psycopg.Connection[Any]) -> Any:
    return (conn.execute("SELECT * FROM logical_agent_connector_leases ORDER BY 1, 2, 3"
                         ).fetchall(),
            conn.execute("SELECT * FROM connector_resource_epochs ORDER BY 1").fetchall())


# Each is one illegal write of the seeded lease row or resource mark. Times are written as
# the library writes them (one clock reading, `t.now`), so only the named fault is illegal.
_NOW = "WITH t AS (SELECT clock_timestamp() AS now) "
_SEED_ROW = f" FROM t WHERE {SEED}"
ILLEGAL = {
    "epoch down": f"UPDATE logical_agent_connector_leases SET epoch = epoch - 1 WHERE {SEED}",
    "epoch to the bigint maximum": "UPDATE logical_agent_connector_leases"
    f" SET epoch = {MAX_EPOCH} WHERE {SEED}",
    "epoch + 1 alone": f"UPDATE logical_agent_connector_leases SET epoch = epoch + 1 WHERE {SEED}",
    "epoch + 2 with a new UUID": _NOW + "UPDATE logical_agent_connector_leases"
    " SET epoch = epoch + 2, lease_id = gen_random_uuid(), acquired_at = t.now,"
    " heartbeat_at = t.now, expires_at = t.now + interval '1 minute', updated_at = t.now"
    + _SEED_ROW,
    "epoch + 1 keeping the UUID": _NOW + "UPDATE logical_agent_connector_leases"
    " SET epoch = epoch + 1, acquired_at = t.now, heartbeat_at = t.now,"
    " expires_at = t.now + interval '1 minute', updated_at = t.now" + _SEED_ROW,
    "lease_id without the epoch": "UPDATE logical_agent_connector_leases"
    f" SET lease_id = gen_random_uuid() WHERE {SEED}",
    "rotate keeping acquired_at": _NOW + "UPDATE logical_agent_connector_leases"
    " SET epoch = epoch + 1, lease_id = gen_random_uuid(), heartbeat_at = t.now,"
    " expires_at = t.now + interval '1 minute', updated_at = t.now" + _SEED_ROW,
    "rotate into a released row": _NOW + "UPDATE logical_agent_connector_leases"
    " SET epoch = epoch + 1, lease_id = gen_random_uuid(), acquired_at = t.now,"
    " heartbeat_at = t.now, expires_at = t.now + interval '1 minute', released_at = t.now,"
    " updated_at = t.now" + _SEED_ROW,
    "expires_at infinity": "UPDATE logical_agent_connector_leases"
    f" SET expires_at = 'infinity' WHERE {SEED}",
    "expires_at far ahead": _NOW + "UPDATE logical_agent_connector_leases"
    " SET heartbeat_at = t.now, expires_at = t.now + interval '1 day', updated_at = t.now"
    + _SEED_ROW,
    "expires_at just past the cap": _NOW + "UPDATE logical_agent_connector_leases"
    " SET heartbeat_at = t.now, expires_at = t.now + interval '5 minutes 1 second',"
    " updated_at = t.now" + _SEED_ROW,
    "expires_at before heartbeat_at": _NOW + "UPDATE logical_agent_connector_leases"
    " SET heartbeat_at = t.now, expires_at = t.now - interval '1 second', updated_at = t.now"
    + _SEED_ROW,
    "heartbeat_at in the future": "WITH t AS (SELECT clock_timestamp() + interval '1 hour'"
    " AS now) UPDATE logical_agent_connector_leases SET heartbeat_at = t.now,"
    " expires_at = t.now + interval '1 minute', updated_at = t.now" + _SEED_ROW,
    "heartbeat_at -infinity": "UPDATE logical_agent_connector_leases"
    f" SET heartbeat_at = '-infinity' WHERE {SEED}",
    "updated_at infinity": "UPDATE logical_agent_connector_leases"
    f" SET updated_at = 'infinity' WHERE {SEED}",
    "acquired_at on a renewal": _NOW + "UPDATE logical_agent_connector_leases"
    " SET acquired_at = t.now, heartbeat_at = t.now, expires_at = t.now + interval '1 minute',"
    " updated_at = t.now" + _SEED_ROW,
    "connector on a renewal": "UPDATE logical_agent_connector_leases"
    f" SET connector_id = 'intruder' WHERE {SEED}",
    "scopes on a renewal": "UPDATE logical_agent_connector_leases"
    f" SET allowed_scopes = ARRAY['admin:*'] WHERE {SEED}",
    "release moving expires_at": _NOW + "UPDATE logical_agent_connector_leases"
    " SET released_at = t.now, expires_at = t.now + interval '5 minutes', updated_at = t.now"
    + _SEED_ROW,
    "released_at infinity": "UPDATE logical_agent_connector_leases"
    f" SET released_at = 'infinity', updated_at = 'infinity' WHERE {SEED}",
    "epoch NULL": f"UPDATE logical_agent_connector_leases SET epoch = NULL WHERE {SEED}",
    "heartbeat_at NULL": "UPDATE logical_agent_connector_leases"
    f" SET heartbeat_at = NULL WHERE {SEED}",
    "insert at epoch 7": _NOW + "INSERT INTO logical_agent_connector_leases"
    " SELECT 'fresh', 'a', 'b', gen_random_uuid(), 'c', '{}', 7, t.now, t.now,"
    " t.now + interval '1 minute', NULL, t.now FROM t",
    "insert with expires_at far ahead": _NOW + "INSERT INTO logical_agent_connector_leases"
    " SELECT 'fresh', 'a', 'b', gen_random_uuid(), 'c', '{}', 1, t.now, t.now,"
    " t.now + interval '1 year', NULL, t.now FROM t",
    "insert released": _NOW + "INSERT INTO logical_agent_connector_leases"
    " SELECT 'fresh', 'a', 'b', gen_random_uuid(), 'c', '{}', 1, t.now, t.now,"
    " t.now + interval '1 minute', t.now, t.now FROM t",
    "resource mark lowered": "UPDATE connector_resource_epochs SET highest_epoch = 1",
}
# Refused to the gateway by privileges (identity columns are not granted), to the owner by
# the triggers.
IDENTITY = {
    "tenant moved": f"UPDATE logical_agent_connector_leases SET tenant_id = 'x' WHERE {SEED}",
    "binding moved": f"UPDATE logical_agent_connector_leases SET binding_id = 'x' WHERE {SEED}",
    "resource renamed": "UPDATE connector_resource_epochs SET resource_id = 'other'",
    "resource moved to another identity":
        "UPDATE connector_resource_epochs SET tenant_id = 'other'",
}


def _refused(dsn: str, statement: str) -> psycopg.Error:
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = _rows(conn)
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(statement.encode())
        assert _rows(conn) == before, statement
    return caught.value


@pytest.mark.parametrize("role", ["gateway", "owner"])
@pytest.mark.parametrize("name", sorted(ILLEGAL))
def test_illegal_shapes_are_refused_to_every_role(layout: Layout, role: str,
                                                  name: str) -> None:
    dsn = layout.gateway_dsn if role == "gateway" else layout.owner_dsn
    refused = _refused(dsn, ILLEGAL[name])
    # The triggers refuse (restrict_violation); a NULL reaches them too, before NOT NULL.
    assert isinstance(refused, errors.RestrictViolation), (name, refused)
    assert "is refused" in str(refused)


@pytest.mark.parametrize("name", sorted(IDENTITY))
def test_identities_never_change(layout: Layout, name: str) -> None:
    assert isinstance(_refused(layout.gateway_dsn, IDENTITY[name]),
                      errors.InsufficientPrivilege)
    assert isinstance(_refused(layout.owner_dsn, IDENTITY[name]), errors.RestrictViolation)


def test_legal_transitions_work_as_the_gateway(layout: Layout) -> None:
    with PostgresLeaseStore(layout.gateway_dsn,
                            settings=ConnectionSettings(schema=layout.schema)) as store:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        ident = LeaseIdentity("legal", "agent", "b1")
        first = gateway.acquire(ident, "c1", scopes=["tool:run"], ttl=300)  # the cap itself
        assert first.lease is not None and first.lease.epoch == 1
        assert gateway.heartbeat(first.lease, ttl=300).ok
        assert all(r.ok for r in gateway.heartbeat_many([first.lease], ttl=30))
        second = gateway.takeover(ident, "c2", scopes=["tool:write"], ttl=30,
                                  expected_epoch=1)  # preempting an active lease
        assert second.lease is not None and second.lease.epoch == 2
        assert gateway.release(second.lease).ok
        third = gateway.takeover(ident, "c3", scopes=[], ttl=30, expected_epoch=2)
        assert third.lease is not None and third.lease.epoch == 3
        assert [(r.epoch, r.connector_id, r.released_at) for r in store.leases("legal")] == [
            (3, "c3", None)]


def test_resource_marks_rise_and_are_never_removed(layout: Layout) -> None:
    with psycopg.connect(layout.gateway_dsn, autocommit=True) as conn:
        conn.execute("UPDATE connector_resource_epochs SET highest_epoch = highest_epoch + 1,"
                     " updated_at = clock_timestamp() WHERE resource_id = 'res'")
        conn.execute("UPDATE connector_resource_epochs SET updated_at = clock_timestamp()")
        assert _refused(layout.gateway_dsn, "UPDATE connector_resource_epochs"
                        " SET updated_at = 'infinity'").sqlstate == "23514"  # CHECK
    for dsn in (layout.gateway_dsn, layout.owner_dsn):
        for statement in ("DELETE FROM connector_resource_epochs",
                          "TRUNCATE connector_resource_epochs"):
            assert isinstance(_refused(dsn, statement),
                              errors.RestrictViolation | errors.InsufficientPrivilege)
    with psycopg.connect(layout.owner_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT highest_epoch FROM connector_resource_epochs"
                            " WHERE resource_id = 'res'").fetchone() == (6,)


def test_writes_ahead_of_the_clock_need_the_owners_allowance(layout: Layout) -> None:
    ident = LeaseIdentity("ahead", "agent", "b1")
    with ShiftedPostgresLeaseStore(layout.gateway_dsn,
                                   settings=ConnectionSettings(schema=layout.schema),
                                   time_offset=timedelta(minutes=10)) as ahead:
        moved = ConnectorLeaseCoordinator(ahead, AllowAllPolicy())
        # Stamped 10 minutes ahead, the lease would last 10 + 5 minutes: refused, and
        # refused again when sent once more (as after a step of the clock inside the
        # statement): nothing is written.
        with pytest.raises(StoreUnavailable, match="no later than the database clock"):
            moved.acquire(ident, "c1", scopes=[], ttl=30)
        assert moved.current_holder(ident) is None
        with psycopg.connect(layout.gateway_dsn, autocommit=True) as conn, \
                pytest.raises(errors.InsufficientPrivilege):
            conn.execute("UPDATE mos_lease_settings SET clock_allowance = interval '1 hour'")
        with psycopg.connect(layout.owner_dsn, autocommit=True) as conn:
            conn.execute("UPDATE mos_lease_settings SET clock_allowance = interval '1 hour'")
        try:
            lease = moved.acquire(ident, "c1", scopes=[], ttl=30).lease
            assert lease is not None
            assert moved.heartbeat(lease, ttl=30).ok
        finally:
            with psycopg.connect(layout.owner_dsn, autocommit=True) as conn:
                conn.execute("UPDATE mos_lease_settings SET clock_allowance = interval '0'")


def test_the_librarys_writes_do_not_call_the_check(pg_admin: psycopg.Connection[Any],
                                                   pg_tenant: str) -> None:
    """The WHEN clause passes a renewal, a takeover and a release of the library's shape,
    stamped by the database clock, without a function call (migration 0006; before it, a
    takeover and a release paid the full PL/pgSQL check); any other write calls the function
    (counted by this transaction's statistics)."""
    check = "'mos_lease_check_lease_write'::regproc"
    calls = f"SELECT coalesce(pg_stat_get_xact_function_calls({check}), 0)"
    key = "tenant_id = %(tenant)s"
    takeover = (_NOW + "UPDATE logical_agent_connector_leases"
                " SET lease_id = gen_random_uuid(), epoch = epoch + 1, acquired_at = t.now,"
                " heartbeat_at = t.now, expires_at = t.now + interval '1 minute',"
                f" released_at = NULL, updated_at = t.now FROM t WHERE {key}")
    with pg_admin.transaction():
        pg_admin.execute("SET LOCAL track_functions = 'pl'")
        pg_admin.execute(_NOW + "INSERT INTO logical_agent_connector_leases"
                         " SELECT %(tenant)s, 'a', 'b', gen_random_uuid(), 'c', '{}', 1,"
                         " t.now, t.now, t.now + interval '1 minute', NULL, t.now FROM t",
                         {"tenant": pg_tenant})
        for _ in range(20):
            pg_admin.execute(_NOW + "UPDATE logical_agent_connector_leases"
                             " SET heartbeat_at = t.now, expires_at = t.now + interval"
                             f" '1 minute', updated_at = t.now FROM t WHERE {key}",
                             {"tenant": pg_tenant})
        pg_admin.execute(takeover, {"tenant": pg_tenant})
        pg_admin.execute(_NOW + "UPDATE logical_agent_connector_leases"
                         " SET released_at = t.now, updated_at = t.now"
                         f" FROM t WHERE {key}", {"tenant": pg_tenant})
        pg_admin.execute(takeover, {"tenant": pg_tenant})
        quiet = pg_admin.execute(calls).fetchone()
        # A release the full check accepts but the library never writes (released_at
        # before updated_at) is judged by the function.
        pg_admin.execute(_NOW + "UPDATE logical_agent_connector_leases"
                         " SET released_at = t.now - interval '1 second', updated_at = t.now"
                         f" FROM t WHERE {key}", {"tenant": pg_tenant})
        odd = pg_admin.execute(calls).fetchone()
    assert (quiet, odd) == ((0,), (1,))


# Writes of a released row, each naming only some columns: the guard is split by the columns
# an UPDATE names (migration 0008), so a write naming none of the identity, lease or release
# columns must still be judged whole.
_RELEASED = "tenant_id = 'released-seed'"
ON_A_RELEASED_ROW = {
    "renewed (times only)": _NOW + "UPDATE logical_agent_connector_leases"
    " SET heartbeat_at = t.now, expires_at = t.now + interval '1 minute', updated_at = t.now"
    f" FROM t WHERE {_RELEASED}",
    "expiry moved alone": "UPDATE logical_agent_connector_leases"
    f" SET expires_at = expires_at + interval '1 second' WHERE {_RELEASED}",
    "stamped again (updated_at only)": _NOW + "UPDATE logical_agent_connector_leases"
    f" SET updated_at = t.now FROM t WHERE {_RELEASED}",
    "unreleased (released_at only)": "UPDATE logical_agent_connector_leases"
    f" SET released_at = NULL WHERE {_RELEASED}",
    "unreleased and renewed": _NOW + "UPDATE logical_agent_connector_leases"
    " SET released_at = NULL, heartbeat_at = t.now, expires_at = t.now + interval '1 minute',"
    f" updated_at = t.now FROM t WHERE {_RELEASED}",
    "released again": _NOW + "UPDATE logical_agent_connector_leases"
    f" SET released_at = t.now, updated_at = t.now FROM t WHERE {_RELEASED}",
}


@pytest.fixture(scope="module")
def released_row(layout: Layout) -> str:
    with psycopg.connect(layout.owner_dsn, autocommit=True) as owner:
        owner.execute(_NOW + "INSERT INTO logical_agent_connector_leases"
                      " SELECT 'released-seed', 'a', 'b', gen_random_uuid(), 'c', '{}', 1,"
                      " t.now, t.now, t.now + interval '1 minute', NULL, t.now FROM t")
        owner.execute(_NOW + "UPDATE logical_agent_connector_leases"
                      f" SET released_at = t.now, updated_at = t.now FROM t WHERE {_RELEASED}")
    return _RELEASED


@pytest.mark.parametrize("role", ["gateway", "owner"])
@pytest.mark.parametrize("name", sorted(ON_A_RELEASED_ROW))
def test_a_released_row_changes_only_by_a_takeover(layout: Layout, released_row: str,
                                                   role: str, name: str) -> None:
    dsn = layout.gateway_dsn if role == "gateway" else layout.owner_dsn
    refused = _refused(dsn, ON_A_RELEASED_ROW[name])
    assert isinstance(refused, errors.RestrictViolation), (name, refused)
    assert "is refused" in str(refused)
