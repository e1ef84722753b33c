"""The supervisor's campaign in batches on PostgreSQL: bindings whose holder stopped are taken
over by one ``takeover_many`` round trip, bindings held by another process are read (one
``load_many``) and not written to, a standby with notices reads far less often than once per
binding per ``max_backoff``, and ``close()`` releases in batches, each loss reported after
its release."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.supervisor import BindingLost, BindingStarted, Change, NewHolder, Supervisor
from mos_lease.testing import ManualNoticeFeed
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome
from mos_lease_pg import LeaseNotices
from tests.pg.test_pg_supervisor import SCOPES, Counted, _settle
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

N = 300
TTL = 30.0


class Clocks:
    """One monotonic clock for the supervisors, moving every store's clock offset with it."""

    def __init__(self, *stores: Any) -> None:
        self.stores = stores
        self.mono = 1000.0

    def __call__(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        for store in self.stores:
            store.advance(seconds)


class Process:
    """A supervisor driven by hand over its own store (counted), as one process."""

    def __init__(self, store: Any, clock: Clocks, notices: ManualNoticeFeed | None = None
                 ) -> None:
        self.store = Counted(store)
        self.changes: list[Change] = []
        self.sleeps: list[float] = []
        self.coordinator = ConnectorLeaseCoordinator(self.store, AllowAllPolicy(),
                                                     monotonic_clock=clock)
        self.supervisor = Supervisor(self.coordinator, on_change=self.changes.append,
                                     clock=clock, sleep=self.sleeps.append,
                                     random=lambda: 0.5, background=False, notices=notices)

    def add(self, identities: list[LeaseIdentity], connector_id: str) -> None:
        for identity in identities:
            self.supervisor.add(identity, connector_id, scopes=SCOPES, ttl=TTL)

    def settle(self) -> None:
        _settle(self.supervisor, self.sleeps)

    def started(self) -> list[BindingStarted]:
        return [c for c in self.changes if isinstance(c, BindingStarted)]


def _identities(tenant: str) -> list[LeaseIdentity]:
    return [LeaseIdentity(tenant, f"agent-{i}", "b") for i in range(N)]


def _events(store: Any, identity: LeaseIdentity) -> list[tuple[LifecycleEvent, Outcome]]:
    return [(r.entry.event, r.entry.outcome) for r in store.audit(identity)]


def test_a_first_pass_reads_bindings_held_elsewhere_in_one_round_trip_and_writes_nothing(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store_a, store_b = pg_stores(), pg_stores()
    clock = Clocks(store_a, store_b)
    identities = _identities(pg_tenant)
    holder = Process(store_a, clock)
    holder.add(identities, "gw-a")
    holder.settle()
    assert len(holder.started()) == N
    standby = Process(store_b, clock)
    standby.add(identities, "gw-b")
    standby.settle()
    assert not standby.started()
    assert standby.store.calls == {"load_many": 1}  # one read of every holder, no write
    for identity in identities:  # the holder's acquire, and no refused acquire of gw-b
        assert _events(store_a, identity) == [(LifecycleEvent.ACQUIRE, Outcome.ACQUIRED)]


def test_leases_left_to_expire_are_taken_over_in_one_round_trip_and_closed_in_one(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store_a, store_b = pg_stores(), pg_stores()
    clock = Clocks(store_a, store_b)
    identities = _identities(pg_tenant)
    stopped = ConnectorLeaseCoordinator(store_a, AllowAllPolicy())
    assert all(r.ok for r in stopped.acquire_many(identities, "gw-a", scopes=SCOPES, ttl=TTL))
    survivor = Process(store_b, clock)
    survivor.add(identities, "gw-b")
    survivor.settle()
    assert not survivor.started()
    survivor.store.calls.clear()
    clock.advance(TTL + 0.5)  # the stopped holder's leases expire
    survivor.settle()
    started = survivor.started()
    assert len(started) == N and {c.lease.epoch for c in started} == {2}
    # One read shows them expired; one takeover_many (at each observed epoch, with the view
    # read, so no read of its own) takes them all.
    assert survivor.store.calls == {"load_many": 1, "takeover_many": 1}
    for identity in identities:
        assert _events(store_a, identity) == [(LifecycleEvent.ACQUIRE, Outcome.ACQUIRED),
                                              (LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER)]

    # close(): one release_many, and each loss reported once the row shows it released.
    seen_released: list[bool] = []

    def on_lost(change: Change) -> None:
        if isinstance(change, BindingLost):
            view = stopped.current_holder(change.identity)
            seen_released.append(view is not None and view.state is LeaseState.RELEASED)

    survivor.supervisor._core.on_change = on_lost
    survivor.store.calls.clear()
    survivor.supervisor.close()
    assert survivor.store.calls == {"release_many": 1}
    assert len(seen_released) == N and all(seen_released)


def test_a_standby_with_notices_reads_at_the_holders_expiry_not_every_backoff(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store_a, store_b = pg_stores(), pg_stores()
    clock = Clocks(store_a, store_b)
    identities = _identities(pg_tenant)
    holder = Process(store_a, clock)
    holder.add(identities, "gw-a")
    holder.settle()
    standby = Process(store_b, clock, ManualNoticeFeed(NoticeConfirmer()))
    standby.add(identities, "gw-b")
    standby.settle()
    standby.store.calls.clear()
    holder.store.calls.clear()
    seconds, step = 2 * TTL, 0.5
    for _ in range(int(seconds / step)):  # a minute of both processes' turns
        clock.advance(step)
        holder.settle()
        standby.settle()
    ticks = holder.store.calls["renew_many"]
    assert ticks >= 5  # renewed every ttl / 3 all along
    assert not standby.started()
    # One batched read per expiry it observed: a handful in a minute, where reading each
    # binding every max_backoff (2 s) would be 30 reads of 300 bindings.
    assert set(standby.store.calls) == {"load_many"}
    assert standby.store.calls["load_many"] <= 3
    holder.supervisor.close()
    standby.supervisor.close()


def test_a_peers_shutdown_is_taken_over_at_once_in_batches_and_is_no_notice_flood(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str,
        caplog: pytest.LogCaptureFixture) -> None:
    # Real time, real notices: a peer holding 2,000 bindings (ttl 30 s) closes; the standby
    # hears 2,000 release notices and takes every lease over within seconds, long before
    # any expiry, reading in batches in a few shared confirming turns: no flood is warned of.
    n = 2000
    names = [LeaseIdentity(pg_tenant, f"peer-{i}", "b") for i in range(n)]
    store_b = Counted(pg_stores())
    confirmer = NoticeConfirmer()
    taken = threading.Event()
    started: list[BindingStarted] = []
    seen: list[NewHolder] = []

    def on_change(change: Change) -> None:
        if isinstance(change, NewHolder):
            seen.append(change)
        if isinstance(change, BindingStarted):
            started.append(change)
            if len(started) == n:
                taken.set()

    with LeaseNotices(pg_dsn, confirmer=confirmer) as notices:
        assert notices.listening.wait(5), notices.refused
        peer = Supervisor(ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy()))
        peer_started = threading.Event()
        count = [0]

        def peer_change(change: Change) -> None:
            if isinstance(change, BindingStarted):
                count[0] += 1
                if count[0] == n:
                    peer_started.set()

        peer._core.on_change = peer_change
        for identity in names:
            peer.add(identity, "gw-a", scopes=SCOPES, ttl=TTL)
        assert peer_started.wait(60)
        with Supervisor(ConnectorLeaseCoordinator(store_b, AllowAllPolicy()),
                        on_change=on_change, notices=notices) as standby:
            for identity in names:
                standby.add(identity, "gw-b", scopes=SCOPES, ttl=TTL)
            deadline = time.monotonic() + 30
            while len(seen) < n:  # the first pass saw every one held by the peer
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.5)
            assert not started
            caplog.clear()
            t0 = time.monotonic()
            peer.close()
            assert taken.wait(15), f"{len(started)} of {n} taken over"
            elapsed = time.monotonic() - t0
            assert {c.lease.epoch for c in started} == {2}
    assert elapsed < 10  # against leases that would expire 30 s after their last renewal
    # The waiting bindings' notices share one confirming turn at a time: a few turns, each
    # reading every binding noticed since the last, none held back by the bound.
    stats = confirmer.stats()
    assert stats.held_back == 0 and 1 <= stats.confirmations <= confirmer.burst
    assert not [r for r in caplog.records if "flood" in r.getMessage()]
    assert store_b.calls.get("takeover_many", 0) <= 2 * (n // 1000) + 4
