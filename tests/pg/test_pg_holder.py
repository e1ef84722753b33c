"""``hold()`` and ``current_holder()`` on a real PostgreSQL server.

Holders race in separate OS processes, each with its own connection; a holder is killed
without releasing; heartbeats are blocked behind a row lock; a rival takes the lease while an
asyncio block runs. The database's audit log is the record the checks read.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    LeaseLost,
    LeaseNotAcquired,
    LossCause,
    Outcome,
    Reason,
    hold,
)
from mos_lease.holder import HoldCallbacks, HoldTiming
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState, LifecycleEvent
from mos_lease_pg import AsyncPostgresLeaseStore, PostgresLeaseStore
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ["tool:run"]


def successes(store: PostgresLeaseStore, identity: LeaseIdentity) -> list[tuple[str, str, int]]:
    return [(r.entry.event.value, r.entry.connector_id, r.entry.epoch or 0)
            for r in store.audit(identity, limit=100_000)
            if r.entry.outcome is not Outcome.DENIED
            and r.entry.event is not LifecycleEvent.GRANT_ISSUE]


def test_current_holder_writes_no_audit_row(pg_dsn: str, pg_stores: StoreFactory,
                                            pg_tenant: str) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    assert gateway.current_holder(identity) is None
    lease = gateway.acquire(identity, "c1", scopes=SCOPES, ttl=30).lease
    assert lease is not None
    before = store.audit(identity)
    view = gateway.current_holder(identity)
    assert isinstance(view, HolderView)
    assert (view.connector_id, view.epoch, view.state) == ("c1", 1, LeaseState.ACTIVE)
    assert view.expires_at == lease.expires_at and view.now < view.expires_at
    assert not hasattr(view, "lease_id") and not hasattr(view, "scopes")
    gateway.release(lease)
    assert gateway.current_holder(identity).state is LeaseState.RELEASED  # type: ignore[union-attr]
    assert len(store.audit(identity)) == len(before) + 1  # the release; the reads wrote none

    async def async_read() -> HolderView | None:
        async_store = AsyncPostgresLeaseStore(pg_dsn)
        try:
            return await AsyncConnectorLeaseCoordinator(
                async_store, AllowAllPolicy()).current_holder(identity)
        finally:
            await async_store.aclose()

    seen = asyncio.run(async_read())
    assert seen is not None and (seen.epoch, seen.state) == (1, LeaseState.RELEASED)
    assert len(store.audit(identity)) == len(before) + 1


# --- racing holders, one process each -----------------------------------------------------------

HOLDERS = 3
HOLDS_EACH = 4


def _race_worker(dsn: str, tenant: str, name: str, inside: Any, overlaps: Any,
                 results: Any) -> None:
    store = PostgresLeaseStore(dsn)
    try:
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        identity = LeaseIdentity(tenant, "agent", "raced")
        epochs = []
        for _ in range(HOLDS_EACH):
            with hold(gateway, identity, name, scopes=SCOPES, ttl=5, wait=60,
                      timing=HoldTiming(clock_step=0, max_backoff=0.1)) as held:
                with inside.get_lock():
                    inside.value += 1
                    if inside.value > 1:
                        overlaps.value += 1
                epochs.append(held.lease.epoch)
                assert held.issue_grant(scopes=SCOPES, ttl=1).ok
                time.sleep(0.02)
                with inside.get_lock():
                    inside.value -= 1
        results.put((name, epochs))
    except BaseException as error:
        results.put((name, repr(error)))
    finally:
        store.close()


def test_racing_holders_hold_one_at_a_time(pg_dsn: str, pg_tenant: str,
                                           pg_stores: StoreFactory) -> None:
    context = multiprocessing.get_context("spawn")
    inside = context.Value("i", 0)
    overlaps = context.Value("i", 0)
    results = context.Queue()
    workers = [context.Process(target=_race_worker, args=(
        pg_dsn, pg_tenant, f"holder-{i}", inside, overlaps, results)) for i in range(HOLDERS)]
    for worker in workers:
        worker.start()
    try:
        reports = dict(results.get(timeout=120) for _ in workers)
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    assert all(isinstance(epochs, list) for epochs in reports.values()), reports
    assert overlaps.value == 0
    won = sorted(e for epochs in reports.values() for e in epochs)
    assert won == list(range(1, HOLDERS * HOLDS_EACH + 1))  # every epoch held once
    # The database agrees: each epoch is won, then released, before the next one is won.
    history = successes(pg_stores(), LeaseIdentity(pg_tenant, "agent", "raced"))
    holders_of = {e: name for name, epochs in reports.items() for e in epochs}
    expected = [(kind, holders_of[epoch], epoch)
                for epoch in range(1, HOLDERS * HOLDS_EACH + 1)
                for kind in ("acquire" if epoch == 1 else "takeover", "release")]
    assert [h for h in history if h[0] != "heartbeat"] == expected


# --- a holder killed without releasing ----------------------------------------------------------

KILLED_HOLDER = textwrap.dedent("""
    import sys, time
    from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity, hold
    from mos_lease.holder import HoldTiming
    from mos_lease_pg import PostgresLeaseStore
    dsn, tenant = sys.argv[1:3]
    gateway = ConnectorLeaseCoordinator(PostgresLeaseStore(dsn), AllowAllPolicy())
    with hold(gateway, LeaseIdentity(tenant, "agent", "killed"), "doomed",
              scopes=["tool:run"], ttl=2, timing=HoldTiming(clock_step=0)) as held:
        print(held.lease.epoch, flush=True)
        time.sleep(60)
""")


def test_waiter_takes_over_once_a_killed_holders_lease_expires(
        pg_dsn: str, pg_tenant: str, pg_stores: StoreFactory) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "killed")
    doomed = subprocess.Popen([sys.executable, "-c", KILLED_HOLDER, pg_dsn, pg_tenant],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert doomed.stdout is not None and doomed.stdout.readline().strip() == "1"
        store = pg_stores()
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        time.sleep(0.8)  # past a renewal or two
        doomed.send_signal(signal.SIGKILL)
        assert doomed.wait(10) == -signal.SIGKILL
        last = gateway.current_holder(identity)
        assert last is not None and last.state is LeaseState.ACTIVE
        seen: list[tuple[str, int]] = []
        with hold(gateway, identity, "survivor", scopes=SCOPES, ttl=2, wait=10,
                  timing=HoldTiming(clock_step=0),
                  callbacks=HoldCallbacks(on_new_holder=lambda c, e: seen.append((c, e)))) as held:
            assert held.lease.epoch == 2
    finally:
        if doomed.poll() is None:
            doomed.kill()
        doomed.wait()
        if doomed.stdout is not None:
            doomed.stdout.close()
    assert seen == [("doomed", 1), ("survivor", 2)]
    [taken] = [r for r in store.audit(identity) if r.entry.event is LifecycleEvent.TAKEOVER
               and r.entry.outcome is Outcome.TAKEN_OVER]
    # Not before the dead holder's lease had run out, by the database's own clock; and
    # promptly after (the waiter wakes when the lease it saw expires).
    assert last.expires_at <= taken.recorded_at < last.expires_at + timedelta(seconds=1)
    assert successes(store, identity)[-1] == ("release", "survivor", 2)


# --- loss while holding -------------------------------------------------------------------------


def test_loss_is_reported_within_the_keeper_bound_when_heartbeats_hang(
        pg_dsn: str, pg_tenant: str, pg_stores: StoreFactory) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "blocked")
    ttl = 1.5
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    heartbeats = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    with psycopg.connect(pg_dsn) as blocker, hold(gateway, identity, "c1", scopes=SCOPES, ttl=ttl,
                                                  heartbeat_coordinator=heartbeats,
                                                  timing=HoldTiming(clock_step=0)) as held:
        # Hold the lease row: every heartbeat waits behind the lock.
        blocked_at = time.monotonic()
        blocker.execute("SELECT 1 FROM mos_lease.logical_agent_connector_leases "
                        "WHERE tenant_id = %s FOR UPDATE", (pg_tenant,))
        loss = held.wait_lost(ttl + 3)
        reported = time.monotonic()
        blocker.rollback()
        assert loss is not None and loss.cause is LossCause.DEADLINE
        # The deadline is at most ttl - margin after the last renewal began (before the
        # block), and loss is reported within 1 s of it.
        assert reported - blocked_at < ttl + 1.0
        with pytest.raises(LeaseLost):
            held.issue_grant(scopes=SCOPES, ttl=1)


def test_release_on_exit_and_a_second_holder_then_takes_over(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "agent", "released")
    with pytest.raises(RuntimeError, match="body"), hold(gateway, identity, "c1", scopes=SCOPES,
                                                         ttl=30, timing=HoldTiming(clock_step=0)):
        raise RuntimeError("body")
    [row] = store.leases(pg_tenant)
    assert row.released_at is not None and row.epoch == 1
    with pytest.raises(LeaseNotAcquired) as refused, hold(gateway, identity, "c2", scopes=SCOPES,
                                                          ttl=30, wait=0, takeover="never",
                                                          timing=HoldTiming(clock_step=0)):
        pass
    assert (refused.value.reason, refused.value.connector_id) == (Reason.TAKEOVER_REQUIRED,
                                                                  "c1")
    with hold(gateway, identity, "c2", scopes=SCOPES, ttl=30, wait=0,
              timing=HoldTiming(clock_step=0)) as held:
        assert held.lease.epoch == 2


def test_async_block_is_cancelled_on_loss(pg_dsn: str, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "async")

    async def scenario() -> float:
        store = AsyncPostgresLeaseStore(pg_dsn)
        rival_store = AsyncPostgresLeaseStore(pg_dsn)
        try:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            rival = AsyncConnectorLeaseCoordinator(rival_store, AllowAllPolicy())
            with pytest.raises(LeaseLost) as raised:
                async with hold(gateway, identity, "c1", scopes=SCOPES, ttl=1.5,
                                cancel_on_loss=True, timing=HoldTiming(clock_step=0)) as held:
                    taken = await rival.takeover(identity, "rival", scopes=SCOPES, ttl=30,
                                                 expected_epoch=held.lease.epoch)
                    assert taken.ok
                    started = time.monotonic()
                    await asyncio.sleep(10)
            assert raised.value.loss.reason is Reason.STALE_EPOCH
            view = await rival.current_holder(identity)
            assert view is not None and (view.connector_id, view.epoch, view.state) == (
                "rival", 2, LeaseState.ACTIVE)  # the loser's exit released nothing
            return time.monotonic() - started
        finally:
            await store.aclose()
            await rival_store.aclose()

    assert asyncio.run(scenario()) < 1.5  # at the next heartbeat, not after the sleep
