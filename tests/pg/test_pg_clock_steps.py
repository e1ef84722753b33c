"""A database clock that steps back: every guarded write earlier than its row's latest stamp
is refused ``clock_behind`` (and audited), the schema refuses such a stamp for every role,
and ``mos-lease check`` reports the step.

A step back is made here with two stores on one database: the row is written by a store
whose time is the database clock plus a minute (a test offset), then written to by a store
at the database clock itself, which to the row looks exactly like the clock having stepped
back by a minute since the row's last write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    Outcome,
    Reason,
)
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_pg.admin.check import Status, run_check
from tests.pg_clock import ShiftedAsyncPostgresLeaseStore
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ["tool:read", "tool:run"]
STEP = timedelta(seconds=60)


def _written_a_minute_ahead(pg_stores: StoreFactory, ident: LeaseIdentity) -> Any:
    ahead = ConnectorLeaseCoordinator(pg_stores(time_offset=STEP), AllowAllPolicy())
    held = ahead.acquire(ident, "c1", scopes=SCOPES, ttl=30)
    assert held.lease is not None
    renewed = ahead.heartbeat(held.lease, ttl=30)
    assert renewed.lease is not None
    return renewed.lease


def test_every_guarded_write_behind_the_rows_stamp_is_refused_and_audited(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    lease = _written_a_minute_ahead(pg_stores, ident)
    store = pg_stores()
    behind = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    before = store.load(ident).row
    assert before is not None

    # The lease is active at the earlier time, the handle is current: only the clock is
    # wrong, and every write is refused for it (a takeover too, though the policy preempts).
    results = {
        "heartbeat": behind.heartbeat(lease, ttl=30),
        "release": behind.release(lease),
        "takeover": behind.takeover(ident, "c2", scopes=SCOPES, ttl=30, expected_epoch=1),
    }
    [batched] = behind.heartbeat_many([lease], ttl=30)
    results["heartbeat_many"] = batched
    for name, result in results.items():
        assert (result.outcome, result.reason) == (Outcome.DENIED, Reason.CLOCK_BEHIND), name
        assert result.current_epoch == 1, name
    assert store.load(ident).row == before  # nothing changed

    refusals = [(r.entry.event, r.entry.reason) for r in store.audit(ident)
                if r.entry.outcome is Outcome.DENIED]
    assert sorted(refusals) == sorted([
        (LifecycleEvent.HEARTBEAT, Reason.CLOCK_BEHIND),
        (LifecycleEvent.HEARTBEAT, Reason.CLOCK_BEHIND),
        (LifecycleEvent.RELEASE, Reason.CLOCK_BEHIND),
        (LifecycleEvent.TAKEOVER, Reason.CLOCK_BEHIND)])

    # Once the clock has passed the row's stamp again, the same handle renews.
    store.advance(STEP + timedelta(seconds=1))
    assert behind.heartbeat(lease, ttl=30).ok


def test_the_asyncio_store_refuses_the_same(pg_dsn: str, pg_stores: StoreFactory,
                                            pg_tenant: str) -> None:
    ident = LeaseIdentity(pg_tenant, "agent", "b5")
    lease = _written_a_minute_ahead(pg_stores, ident)

    async def scenario() -> list[Reason | None]:
        async with ShiftedAsyncPostgresLeaseStore(pg_dsn) as store:
            behind = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            return [(await behind.heartbeat(lease, ttl=30)).reason,
                    (await behind.heartbeat_many([lease], ttl=30))[0].reason,
                    (await behind.release(lease)).reason,
                    (await behind.takeover(ident, "c2", scopes=SCOPES, ttl=30,
                                           expected_epoch=1)).reason]

    assert asyncio.run(scenario()) == [Reason.CLOCK_BEHIND] * 4


def test_a_stale_holder_still_learns_it_is_stale_when_the_clock_is_behind(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    ident = LeaseIdentity(pg_tenant, "agent", "b2")
    ahead = ConnectorLeaseCoordinator(pg_stores(time_offset=STEP), AllowAllPolicy())
    first = ahead.acquire(ident, "c1", scopes=SCOPES, ttl=30)
    assert first.lease is not None
    assert ahead.takeover(ident, "c2", scopes=SCOPES, ttl=30, expected_epoch=1).ok
    behind = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    assert behind.heartbeat(first.lease, ttl=30).reason is Reason.STALE_EPOCH


def test_the_schema_refuses_a_stamp_earlier_than_the_rows_for_every_role(
        pg_stores: StoreFactory, pg_admin: psycopg.Connection[Any], pg_tenant: str) -> None:
    # A renewal-shaped UPDATE stamped by the database clock itself is legal in every other
    # respect (0002's checks pass it); as superuser, triggers fire all the same.
    ident = LeaseIdentity(pg_tenant, "agent", "b3")
    _written_a_minute_ahead(pg_stores, ident)
    with pytest.raises(psycopg.errors.RestrictViolation, match="stepped back"):
        pg_admin.execute(
            "UPDATE logical_agent_connector_leases SET heartbeat_at = clock_timestamp(), "
            "expires_at = clock_timestamp() + interval '10 seconds', "
            "updated_at = clock_timestamp() WHERE tenant_id = %s", (pg_tenant,))


def test_check_reports_a_clock_behind_the_newest_lease_stamp(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    ident = LeaseIdentity(pg_tenant, "agent", "b4")
    _written_a_minute_ahead(pg_stores, ident)
    report, code = run_check(pg_dsn)
    [item] = [i for i in report.items if i.name == "clock_steps"]
    assert item.status is Status.PROBLEM, item
    assert "behind the newest lease stamp" in item.value
    assert item.fix is not None and "clock_behind" in item.fix
    assert code == 1


def _once(pg_admin: psycopg.Connection[Any], pg_tenant: str, name: str, table: str,
          event: str, then: str) -> Iterator[str]:
    """A trigger that runs ``then`` on the first row of ``pg_tenant`` that ``event`` writes
    to ``table`` after this. A sequence counts, since the refused statement rolls back
    everything else it did. Triggers fire in name order: this one (``a_...``) before the
    schema's checks."""
    name = f"{name}_{pg_tenant.replace('-', '_')}"
    pg_admin.execute(f"CREATE SEQUENCE {name}")
    pg_admin.execute(f"""
        CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.tenant_id = '{pg_tenant}' AND nextval('{name}') = 1 THEN
                {then}
            END IF;
            RETURN NEW;
        END $$""")
    pg_admin.execute(f"CREATE TRIGGER a_{name} BEFORE {event} ON {table} "
                     f"FOR EACH ROW EXECUTE FUNCTION {name}()")
    try:
        yield name
    finally:
        pg_admin.execute(f"DROP TRIGGER a_{name} ON {table}")
        pg_admin.execute(f"DROP FUNCTION {name}()")
        pg_admin.execute(f"DROP SEQUENCE {name}")


@pytest.fixture
def stepped_once(pg_admin: psycopg.Connection[Any], pg_tenant: str) -> Iterator[str]:
    """The database clock seen to step back inside one statement, once: the first audit row
    of ``pg_tenant`` written after this is stamped a minute before its statement began, as a
    row stamped just before the clock stepped back looks to the schema's stamp check (which
    compares the stamp with the clock when the row is inserted)."""
    yield from _once(pg_admin, pg_tenant, "step_once", "connector_lease_audit_log", "INSERT",
                     "NEW.recorded_at := NEW.recorded_at - interval '1 minute';")


@pytest.fixture
def row_stepped_once(pg_admin: psycopg.Connection[Any], pg_tenant: str) -> Iterator[str]:
    """As :func:`stepped_once`, for the lease row: the first update of a lease of
    ``pg_tenant`` written after this is refused as the schema refuses a row stamped just
    before the clock stepped back (its check that a write is stamped no later than the
    database clock, which a trigger's ``WHEN`` makes before any earlier trigger's change to
    the row is seen, so the refusal itself is what is played here)."""
    yield from _once(pg_admin, pg_tenant, "row_step_once", "logical_agent_connector_leases",
                     "UPDATE", "RAISE EXCEPTION 'mos-lease: % on % is refused: %', TG_OP, "
                     "TG_TABLE_NAME, 'a write is stamped no later than the database clock' "
                     "USING ERRCODE = 'restrict_violation';")


@pytest.mark.parametrize("refusing", ["stepped_once", "row_stepped_once"])
@pytest.mark.parametrize("call", ["heartbeat", "heartbeat_many", "release"])
def test_a_step_back_inside_the_statement_sends_the_write_once_more(
        pg_stores: StoreFactory, pg_tenant: str, pg_admin: psycopg.Connection[Any],
        call: str, refusing: str, request: pytest.FixtureRequest) -> None:
    # The schema refuses the audit row (its stamp lies outside the statement's run) or the
    # lease row (stamped later than the clock), so the statement rolled back and wrote
    # nothing: the store sends it once more, which reads the clock again. Once it raised
    # InternalInconsistency, as if the schema had found a bug.
    coordinator = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    ident = LeaseIdentity(pg_tenant, "agent", f"step-{call}")
    held = coordinator.acquire(ident, "c1", scopes=SCOPES, ttl=30)
    assert held.lease is not None
    name = request.getfixturevalue(refusing)
    if call == "heartbeat":
        result = coordinator.heartbeat(held.lease, ttl=30)
    elif call == "heartbeat_many":
        [result] = coordinator.heartbeat_many([held.lease], ttl=30)
    else:
        result = coordinator.release(held.lease)
    assert result.ok, result
    [stepped] = pg_admin.execute(f"SELECT last_value FROM {name}").fetchone() or [None]
    assert stepped >= 2  # the refused statement and the one sent again
    # The acquire and this write, once: nothing of the refused statement.
    outcomes = [r.entry.outcome for r in pg_stores().audit(ident)]
    assert outcomes == [Outcome.ACQUIRED,
                        Outcome.RELEASED if call == "release" else Outcome.RENEWED]
