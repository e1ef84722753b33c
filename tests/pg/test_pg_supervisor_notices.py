"""The supervisor with one ``LeaseNotices`` listener on PostgreSQL: a rival's takeover of one
binding is reported within a second against a 30 s ttl, and 10,000 forged notices from a
login without any privilege cost at most the confirmer's bound of reads and end no holding.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    LossCause,
    Reason,
)
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.supervisor import (
    AsyncSupervisor,
    BindingLost,
    BindingStarted,
    Change,
    NewHolder,
    Supervisor,
)
from mos_lease_pg import AsyncPostgresLeaseStore, LeaseNotices
from tests.notice_flood import Heard, count_loads, send_flood, turn_bound, unprivileged_login
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ("tool:run",)
TTL = 30.0
FAST = 1.0  # seconds: "at once", against a 30 s ttl whose local deadline is 25 s away
FLOOD = 10_000


@pytest.fixture
def own_notices(pg_dsn: str) -> Iterator[LeaseNotices]:
    """A listener with a confirmer of its own: its counts belong to this test alone."""
    with LeaseNotices(pg_dsn, confirmer=NoticeConfirmer()) as source:
        assert source.listening.wait(5), source.refused
        yield source


class Watch:
    """The changes of a supervisor, and an event set at the first loss that is not a stop."""

    def __init__(self) -> None:
        self.changes: list[Change] = []
        self.lost = threading.Event()
        self.lost_at: float | None = None

    def __call__(self, change: Change) -> None:
        self.changes.append(change)
        if isinstance(change, BindingLost) and change.loss.cause is not LossCause.STOPPED:
            self.lost_at = time.monotonic()
            self.lost.set()

    def started(self) -> int:
        return sum(isinstance(c, BindingStarted) for c in self.changes)


def _wait(check: Any, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_rival_takeover_is_reported_well_before_the_deadline(
        pg_stores: StoreFactory, pg_tenant: str, own_notices: LeaseNotices) -> None:
    store = pg_stores()
    loads = count_loads(store)
    watch = Watch()
    identities = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(100)]
    with Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()), on_change=watch,
                    notices=own_notices) as supervisor:
        for identity in identities:
            supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=TTL)
        _wait(lambda: watch.started() == len(identities), 20)
        before = {i: supervisor.lease(i) for i in identities}
        reads = loads[0]
        rival = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
        victim = identities[37]
        took_at = time.monotonic()
        assert rival.takeover(victim, "gw-b", scopes=SCOPES, ttl=TTL, expected_epoch=1).ok
        assert watch.lost.wait(FAST), "no loss reported within a second"
        assert watch.lost_at is not None and watch.lost_at - took_at < FAST
        _wait(lambda: any(isinstance(c, NewHolder) for c in watch.changes), FAST)
        [lost] = [c for c in watch.changes if isinstance(c, BindingLost)]
        assert (lost.identity, lost.loss.cause, lost.loss.reason) == (
            victim, LossCause.DENIED, Reason.STALE_EPOCH)
        [seen] = [c for c in watch.changes if isinstance(c, NewHolder)]
        assert (seen.identity, seen.holder.connector_id, seen.holder.epoch) == (
            victim, "gw-b", 2)
        assert loads[0] - reads == 1  # the one confirming read
        assert supervisor.lease(victim) is None
        assert all(supervisor.lease(i) == before[i] for i in identities if i != victim)
        # The notice of the supervisor's own release of the others costs no read either.


def test_the_asyncio_supervisor_reports_a_rival_takeover_well_before_the_deadline(
        pg_dsn: str, pg_tenant: str, own_notices: LeaseNotices) -> None:
    identities = [LeaseIdentity(pg_tenant, f"async-{i}", "b") for i in range(50)]

    async def main() -> float:
        store = AsyncPostgresLeaseStore(pg_dsn)
        rival_store = AsyncPostgresLeaseStore(pg_dsn)
        try:
            coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            async with AsyncSupervisor(coordinator, notices=own_notices) as supervisor:
                changes = supervisor.changes()
                for identity in identities:
                    supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=TTL)
                started = 0
                async for change in changes:
                    started += isinstance(change, BindingStarted)
                    if started == len(identities):
                        break
                rival = AsyncConnectorLeaseCoordinator(rival_store, AllowAllPolicy())
                took_at = time.monotonic()
                assert (await rival.takeover(identities[9], "gw-b", scopes=SCOPES, ttl=TTL,
                                             expected_epoch=1)).ok
                async with asyncio.timeout(FAST):
                    async for change in changes:
                        if isinstance(change, BindingLost):
                            assert change.identity == identities[9]
                            assert change.loss.reason is Reason.STALE_EPOCH
                            return time.monotonic() - took_at
            raise AssertionError("the changes ended")
        finally:
            await store.aclose()
            await rival_store.aclose()

    assert asyncio.run(main()) < FAST


def test_ten_thousand_forged_notices_cost_the_bound_of_reads_and_no_holding(
        pg_dsn: str, pg_admin: psycopg.Connection[Any], pg_stores: StoreFactory,
        pg_tenant: str, own_notices: LeaseNotices) -> None:
    # 10,000 distinct takeover notices of newer epochs over 10 bindings, from a login with
    # no privilege at all, against 5 s leases (renewed every ~1.7 s, local deadline 4.5 s
    # after a renewal's start): 6 s later every binding is still held, its renewals went
    # out all along, and the reads are within the confirmer's bound.
    store = pg_stores()
    loads = count_loads(store)
    renewals: list[float] = []
    real_renew_many = store.renew_many

    def renew_many(items: Any) -> Any:
        renewals.append(time.monotonic())
        return real_renew_many(items)

    store.renew_many = renew_many  # type: ignore[method-assign,assignment]
    watch = Watch()
    confirmer = own_notices.confirmer
    identities = [LeaseIdentity(pg_tenant, f"flooded-{i}", "b") for i in range(10)]
    heard = Heard(own_notices, *identities)
    with Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()), on_change=watch,
                    notices=own_notices) as supervisor:
        for identity in identities:
            supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=5, clock_step=0)
        _wait(lambda: watch.started() == len(identities), 10)
        reads = loads[0]
        with unprivileged_login(pg_admin, pg_dsn) as forger:
            began = time.monotonic()
            send_flood(forger, own_notices.channel, identities, FLOOD // len(identities), 1)
            heard.all(FLOOD)
        assert not watch.lost.wait(max(0.0, began + 6 - time.monotonic()))
        window = time.monotonic() - began
        flood_reads = loads[0] - reads
        stats = confirmer.stats()
        assert all(supervisor.lease(i) is not None for i in identities)
        assert (supervisor.issue_grant(identities[0], scopes=SCOPES, ttl=1)).ok
    assert watch.started() == len(identities)  # nothing lost, nothing taken again
    assert stats.notices == FLOOD and stats.held_back >= 1
    # One read per confirming turn; the turns within burst + rate * T (10 + 20/s).
    assert 1 <= flood_reads <= stats.confirmations
    assert stats.confirmations <= turn_bound(confirmer.rate, confirmer.burst, window) + 1
    during = [t for t in renewals if began <= t <= began + window]
    assert len(during) >= 3 and max(b - a for a, b in itertools.pairwise(during)) < 2.5
