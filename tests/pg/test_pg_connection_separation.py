"""On PostgreSQL: a call stuck on one connection never holds up validation on another, and a
reply that arrives after its validity ran out never runs the adapter.

* Separation: a gateway keeps its keeper's heartbeats on a store (a connection) of its own
  (``heartbeat_coordinator``) and issues and validates grants through another. The keeper's
  heartbeat is made to hang for real (blocked behind a row lock another session holds, with
  a long ``lock_timeout``), and validations on the other connection go on answering in normal
  time until the keeper reports the loss at its deadline.
* In flight: the reply to a validation's read is delayed for real (a store that sleeps after
  ``load`` returned); ``invoke`` refuses instead of running the adapter a second after the
  context's expiry.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    Reason,
)
from mos_lease.keeper import LeaseKeeper, LossCause
from mos_lease.records import Snapshot
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from tests.pg_fixtures import StoreFactory
from tests.pg_support import unique_name

pytestmark = [pytest.mark.pg, pytest.mark.faults]

SCOPES = ("tool:run",)
NORMAL = 0.5  # seconds: a validation on an idle local server answers far faster than this


def _waiting_on_a_lock(admin: psycopg.Connection[Any], application: str) -> bool:
    row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                        " AND wait_event_type = 'Lock'", (application,)).fetchone()
    return row is not None and row[0] > 0


def test_a_stuck_heartbeat_does_not_hold_up_validation_on_another_connection(
        pg_dsn: str, pg_stores: StoreFactory, pg_admin: psycopg.Connection[Any],
        pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    policy = AllowAllPolicy()
    application = unique_name("keeper")
    # Store A: the keeper's heartbeats only. Its lock wait is allowed to last far longer
    # than the test, so the heartbeat stays stuck until the keeper gives up on it.
    keeper_store = pg_stores(settings=ConnectionSettings(
        application_name=application, lock_timeout=timedelta(seconds=60),
        statement_timeout=timedelta(seconds=60)))
    # Store B: acquire, grants and validation.
    work = ConnectorLeaseCoordinator(pg_stores(), policy)
    keeper = LeaseKeeper(work, clock_step=0, ttl=3.0, clock=time.monotonic,
                         heartbeat_coordinator=ConnectorLeaseCoordinator(keeper_store, policy))
    try:
        assert keeper.acquire(identity, "c1", scopes=SCOPES).ok
        grant = keeper.issue_grant(scopes=SCOPES, ttl=30).grant
        assert grant is not None
        latencies: list[float] = []
        with psycopg.connect(pg_dsn) as locker:
            # A table lock that lets reads through: a renewal batch, which skips a locked
            # row but must lock the table's rows, waits on it (a row lock would only be
            # skipped, and the renewal retried, not stuck).
            locker.execute("LOCK TABLE mos_lease.logical_agent_connector_leases"
                           " IN EXCLUSIVE MODE")
            stuck_seen = False
            while not keeper.lost.is_set():
                began = time.monotonic()
                checked = work.validate(grant, identity=identity, scopes=SCOPES)
                latencies.append(time.monotonic() - began)
                assert checked.ok, checked  # the lease is live in the database throughout
                stuck_seen = stuck_seen or _waiting_on_a_lock(pg_admin, application)
                time.sleep(0.05)
            locker.rollback()
        loss = keeper.loss
        assert loss is not None and loss.cause is LossCause.DEADLINE
        assert stuck_seen  # the keeper's heartbeat really was stuck behind the lock
        assert len(latencies) >= 10
        print(f"{len(latencies)} validations during the stuck heartbeat, slowest "
              f"{max(latencies) * 1000:.1f} ms")
        assert max(latencies) < NORMAL
        # The heartbeat that waited out the lock was abandoned at the deadline: whatever it
        # did once the lock was gone, the keeper stays lost and mints no grant.
        assert keeper.issue_grant(scopes=SCOPES, ttl=5).reason is Reason.LEASE_EXPIRED
    finally:
        keeper.stop(release=False)


class SlowReplies(PostgresLeaseStore):
    """Every ``load`` reply reaches the coordinator ``delay`` seconds after the database
    answered: a slow network or a stalled process between the read and its use."""

    delay = 0.0

    def load(self, identity: LeaseIdentity) -> Snapshot:
        snapshot = super().load(identity)
        time.sleep(self.delay)
        return snapshot


def test_invoke_never_runs_the_adapter_on_a_reply_that_outlived_the_context(
        pg_dsn: str, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    store = SlowReplies(pg_dsn)
    with store:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        lease = gateway.acquire(identity, "c1", scopes=SCOPES, ttl=60).lease
        assert lease is not None
        grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=1).grant
        assert grant is not None
        store.delay = 2.0  # the reply arrives about 1 s after the grant's expiry
        ran: list[tuple[ConnectorExecutionContext, datetime]] = []

        def adapter(ctx: ConnectorExecutionContext) -> None:
            ran.append((ctx, store.now()))

        result = gateway.invoke(grant, adapter, identity=identity, scopes=SCOPES)
        lateness = [(now - ctx.expires_at).total_seconds() for ctx, now in ran]
        assert ran == [], f"adapter ran {lateness} s after ctx.expires_at"
        assert result.reason is Reason.GRANT_EXPIRED
        store.delay = 0.0
        last = store.audit(identity)[-1].entry
        assert (last.event, last.reason) == (LifecycleEvent.GRANT_VALIDATE,
                                             Reason.GRANT_EXPIRED)


def test_a_prompt_reply_still_validates(pg_dsn: str, pg_tenant: str) -> None:
    """The check costs nothing to a gateway whose replies come in normal time."""
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    store = SlowReplies(pg_dsn)
    with store:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        lease = gateway.acquire(identity, "c1", scopes=SCOPES, ttl=60).lease
        assert lease is not None
        grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=2).grant
        assert grant is not None
        store.delay = 0.5  # slow, but well within the 2 s the reply reports
        assert gateway.validate(grant, identity=identity, scopes=SCOPES).ok
