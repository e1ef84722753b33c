"""The supervisor's one notice listener (``notices=``) on the in-memory store, with a fake
source: a notice for a binding costs at most one confirming read, bounded for the process by
the notice confirmer; a takeover it confirms is reported at once and the campaign goes on; a
flood of forged notices ends no holding and holds up no renewal."""

from __future__ import annotations

import asyncio
import threading
import time as wall_time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    LossCause,
    Reason,
)
from mos_lease.keep.schedule import superseded
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.records import LeaseHandle
from mos_lease.results import HolderView
from mos_lease.supervisor import (
    AsyncSupervisor,
    BindingLost,
    BindingStarted,
    Change,
    NewHolder,
    Supervisor,
)
from mos_lease.testing import ManualNoticeFeed
from mos_lease.vocabulary import LeaseState
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.core.test_supervisor import SCOPES, TTL, Rig, ident


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (in real time) for the confirmer's thread to have done what ``check`` sees."""
    deadline = wall_time.monotonic() + timeout
    while not check():
        assert wall_time.monotonic() < deadline, "the confirmer never got to it"
        wall_time.sleep(0.002)


class NoticeRig(Rig):
    """The turn-by-turn rig of ``test_supervisor.py``, with a fake source whose confirmer
    measures its bound on the supervisor's manual clock."""

    def __init__(self, rate: float = 20.0, burst: int = 10) -> None:
        super().__init__()
        self.supervisor.close()  # the rig's own one, without notices: replaced below
        self.changes.clear()
        self.confirmer = NoticeConfirmer(rate=rate, burst=burst, clock=self.time)
        self.feed = ManualNoticeFeed(self.confirmer)
        self.supervisor = Supervisor(self.coordinator, on_change=self.changes.append,
                                     clock=self.time, sleep=self.sleeps.append,
                                     random=lambda: 0.5, background=False, notices=self.feed)

    def confirming(self, identity: LeaseIdentity) -> bool:
        """Whether a confirming read of ``identity`` waits for the supervisor's turn."""
        slot = self.supervisor._core.schedule.slots[identity]
        return slot.confirm

    def loads(self) -> int:
        return self.store.rows_read

    def held(self, n: int) -> LeaseHandle:
        lease = self.supervisor.lease(ident(n))
        assert lease is not None
        return lease


def test_a_confirmed_takeover_is_reported_at_once_and_the_others_stay_untouched() -> None:
    rig = NoticeRig()
    rig.add(5)
    rig.settle()
    before = {i: rig.held(i) for i in range(5)}
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    assert rival.takeover(ident(2), "gw-b", scopes=SCOPES, ttl=TTL, expected_epoch=1).ok
    rig.store.reset()
    rig.feed.send(ident(2), 2)
    eventually(lambda: rig.confirming(ident(2)))
    at = rig.time.mono
    rig.settle()  # no time passes: the loss is found by the read, not at a deadline
    [lost] = rig.of(BindingLost)
    assert lost.identity == ident(2) and lost.lease == before[2]
    assert (lost.loss.cause, lost.loss.reason, lost.loss.at) == (
        LossCause.DENIED, Reason.STALE_EPOCH, at)
    assert "epoch 2 held by gw-b" in (lost.loss.error or "")
    [seen] = rig.of(NewHolder, ident(2))
    assert (seen.holder.connector_id, seen.holder.epoch) == ("gw-b", 2)
    assert rig.store.calls == {"load_many": 1}  # one confirming read, and nothing else
    assert rig.loads() == 1
    assert rig.supervisor.lease(ident(2)) is None
    assert all(rig.held(i) == before[i] for i in range(5) if i != 2)
    # The turn is over: the next notice is confirmed again, by one read of its own.
    eventually(lambda: not rig.confirmer._gate.pending(ident(2)))


def test_after_a_confirmed_loss_a_released_lease_is_taken_over_at_once() -> None:
    rig = NoticeRig()
    rig.add(2)
    rig.settle()
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    taken = rival.takeover(ident(0), "gw-b", scopes=SCOPES, ttl=300, expected_epoch=1)
    assert taken.ok and taken.lease is not None
    rig.feed.send(ident(0), 2)
    eventually(lambda: rig.confirming(ident(0)))
    rig.settle()
    assert [c.identity for c in rig.of(BindingLost)] == [ident(0)]
    rig.store.reset()
    rig.run(30)  # waiting out an active lease: no read before its expiry, no takeover
    assert len(rig.of(BindingStarted, ident(0))) == 1 and rig.loads() == 0
    assert rival.release(taken.lease).ok
    rig.feed.send(ident(0), 2, "release")
    rig.settle()  # no time passes: the read shows it released, the takeover follows
    started = rig.of(BindingStarted, ident(0))
    assert [c.lease.epoch for c in started] == [1, 3]
    assert rig.held(0) == started[-1].lease
    assert rig.confirmer.stats().notices == 1  # only the held binding's took a turn


def test_a_notice_wakes_a_campaign_waiting_for_an_active_lease() -> None:
    rig = NoticeRig()
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    theirs = rival.acquire(ident(0), "gw-b", scopes=SCOPES, ttl=300).lease
    assert theirs is not None
    rig.add(1)
    rig.run(20)
    assert rig.of(NewHolder, ident(0)) and not rig.of(BindingStarted)
    assert rig.loads() == 1  # read once, then waited out to its expiry (300 s)
    assert rival.release(theirs).ok
    rig.feed.send(ident(0), 1, "release")
    rig.settle()
    [started] = rig.of(BindingStarted, ident(0))
    assert started.lease.epoch == 2
    assert rig.loads() == 2 and rig.confirmer.stats().notices == 0


def test_a_notice_soon_after_a_read_is_a_reason_to_look_now() -> None:
    rig = NoticeRig()
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    theirs = rival.acquire(ident(0), "gw-b", scopes=SCOPES, ttl=300).lease
    assert theirs is not None
    rig.add(1, max_backoff=3)
    rig.settle()  # read at once: waiting it out to its expiry
    rig.time.advance(1)  # less than max_backoff after that read
    assert rival.release(theirs).ok
    rig.feed.send(ident(0), 1, "release")
    # A confirming turn (within the confirmer's bound) moves the read to now.
    slot = rig.supervisor._core.schedule.slots[ident(0)]
    eventually(lambda: slot.try_at == rig.time.mono)
    rig.settle()
    [started] = rig.of(BindingStarted, ident(0))
    assert started.lease.epoch == 2 and rig.loads() == 2
    assert rig.confirmer.stats().confirmations == 1
    eventually(lambda: not rig.supervisor._core.looking)  # the turn is over


def test_notices_for_a_waiting_binding_read_it_within_the_confirmers_bound() -> None:
    rate, burst, seconds = 0.1, 1, 20.0
    rig = NoticeRig(rate=rate, burst=burst)
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    assert rival.acquire(ident(0), "gw-b", scopes=SCOPES, ttl=300).ok
    rig.add(1, max_backoff=4)
    rig.settle()
    rig.store.reset()
    for _ in range(40):  # a notice every 0.5 s for 20 s, forged: nothing changed
        rig.feed.send(ident(0), 9)
        rig.settle()
        rig.time.advance(0.5)
    rig.settle()
    # A look per max_backoff (as without notices), and the confirming turns the confirmer
    # allowed for notices that came sooner (one more may have started since).
    confirmations = rig.confirmer.stats().confirmations
    assert confirmations <= burst + rate * seconds + 1
    assert seconds / 4 - 1 <= rig.loads() <= seconds / 4 + 1 + confirmations
    assert not rig.of(BindingStarted)


def test_notices_that_are_not_worth_a_read_cost_nothing() -> None:
    rig = NoticeRig()
    rig.add(3)
    rig.settle()
    rig.store.reset()
    # Identities the supervisor does not run, and the epoch it holds (its own takeover's
    # notice): no read, no confirming turn, nothing registered with the confirmer.
    for k in range(10_000):
        rig.feed.send(LeaseIdentity("acme", f"stranger-{k}", "b"), 7)
    for i in range(3):
        rig.feed.send(ident(i), 1)
    rig.run(2)
    assert rig.loads() == 0
    assert rig.confirmer.stats().notices == 0
    assert rig.supervisor._notices is not None and not rig.supervisor._notices._jobs


def test_a_forged_notice_ends_no_holding() -> None:
    rig = NoticeRig()
    rig.add(3)
    rig.settle()
    rig.store.reset()  # the first pass read every holder
    rig.feed.send(ident(1), 99)
    eventually(lambda: rig.confirming(ident(1)))
    rig.settle()
    assert rig.loads() == 1 and not rig.of(BindingLost)
    assert rig.held(1).epoch == 1


def test_a_confirming_read_that_fails_confirms_nothing_and_ends_the_turn() -> None:
    rig = NoticeRig()
    rig.add(2)
    rig.settle()
    rig.store.down = True
    rig.feed.send(ident(0), 5)
    eventually(lambda: rig.confirming(ident(0)))
    rig.settle()
    assert not rig.of(BindingLost)
    eventually(lambda: not rig.confirmer._gate.pending(ident(0)))
    rig.store.down = False
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    assert rival.takeover(ident(0), "gw-b", scopes=SCOPES, ttl=TTL, expected_epoch=1).ok
    rig.feed.send(ident(0), 2)
    eventually(lambda: rig.confirming(ident(0)))
    rig.settle()
    assert [c.loss.reason for c in rig.of(BindingLost)] == [Reason.STALE_EPOCH]


def test_a_forged_flood_ends_no_holding_holds_up_no_renewal_and_reads_within_the_bound(
        ) -> None:
    rate, burst, seconds = 2.0, 3, 40.0
    rig = NoticeRig(rate=rate, burst=burst)
    n = 50
    rig.add(n)
    rig.settle()
    rig.store.reset()
    began = rig.time.mono
    sent = 0
    while rig.time.mono < began + seconds:
        for k in range(250):  # newer epochs on every binding, 500 notices a second
            rig.feed.send(ident(k % n), 2 + sent // n)
            sent += 1
        rig.settle()
        rig.time.advance(0.5)
    rig.settle()
    elapsed = rig.time.mono - began
    stats = rig.confirmer.stats()
    assert sent == 20_000 and stats.notices == sent
    assert not rig.of(BindingLost)
    assert all(rig.held(i).epoch == 1 for i in range(n))
    # Renewed every ttl / 3 = 10 s all along: four ticks in 40 s, one round trip each.
    assert rig.store.calls["renew_many"] == 4
    # One read per confirming turn, and the turns within the confirmer's bound (one more
    # may have started since the counts were read).
    assert 1 <= rig.loads() <= stats.confirmations <= burst + rate * elapsed + 1
    assert stats.held_back >= 1


def test_remove_ends_the_turn_and_later_notices_cost_nothing() -> None:
    rig = NoticeRig()
    rig.add(2)
    rig.settle()
    rig.store.reset()  # the first pass read every holder
    rig.feed.send(ident(0), 4)
    eventually(lambda: rig.confirming(ident(0)))
    assert rig.supervisor.remove(ident(0)) is not None
    assert not rig.supervisor._core.confirming  # the turn given back with the binding
    assert rig.supervisor._notices is not None and ident(0) not in rig.supervisor._notices._jobs
    before = rig.confirmer.stats().notices
    rig.feed.send(ident(0), 5)
    rig.settle()
    assert rig.loads() == 0 and rig.confirmer.stats().notices == before


def test_close_unsubscribes_and_bad_sources_are_refused() -> None:
    rig = NoticeRig()
    rig.add(1)
    rig.settle()
    assert rig.feed.subscribers == 1  # one subscription, whatever the number of bindings
    rig.supervisor.close()
    assert rig.feed.subscribers == 0
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    for bad in (object(), "postgresql://", 5):
        with pytest.raises(ConfigurationError, match="subscribe_all"):
            Supervisor(coordinator, notices=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="subscribe_all"):
        AsyncSupervisor(AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore()),
                        notices=object())  # type: ignore[arg-type]


def test_superseded_is_a_newer_epoch_or_the_same_one_released() -> None:
    lease = LeaseHandle(ident(0), "gw-a", uuid.uuid4(), 3, ("tool:run",),
                        datetime(2030, 1, 1, tzinfo=UTC))
    now = datetime(2030, 1, 1, tzinfo=UTC)

    def view(epoch: int, state: LeaseState) -> HolderView:
        return HolderView("gw-x", epoch, state, now + timedelta(seconds=5), now)

    assert superseded(lease, None, 1.0) is None
    assert superseded(lease, view(2, LeaseState.RELEASED), 1.0) is None
    assert superseded(lease, view(3, LeaseState.ACTIVE), 1.0) is None
    assert superseded(lease, view(3, LeaseState.EXPIRED), 1.0) is None  # the renewal decides
    released = superseded(lease, view(3, LeaseState.RELEASED), 1.0)
    assert released is not None and released.reason is Reason.LEASE_RELEASED
    newer = superseded(lease, view(4, LeaseState.ACTIVE), 2.0)
    assert newer is not None and (newer.cause, newer.reason, newer.at) == (
        LossCause.DENIED, Reason.STALE_EPOCH, 2.0)


# --- with their own thread or task, on real time ---------------------------------------------


def test_the_thread_supervisor_reports_a_takeover_well_before_its_deadline() -> None:
    store = InMemoryLeaseStore()
    feed = ManualNoticeFeed(NoticeConfirmer())
    lost = threading.Event()
    changes: list[Change] = []

    def on_change(change: Change) -> None:
        changes.append(change)
        if isinstance(change, BindingLost):
            lost.set()

    with Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()), on_change=on_change,
                    notices=feed) as supervisor:
        for i in range(20):
            supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
        eventually(lambda: all(supervisor.lease(ident(i)) for i in range(20)))
        rival = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        assert rival.takeover(ident(4), "gw-b", scopes=SCOPES, ttl=TTL, expected_epoch=1).ok
        began = wall_time.monotonic()
        feed.send(ident(4), 2)
        assert lost.wait(1.0), "no loss reported within a second (ttl 30)"
        assert wall_time.monotonic() - began < 1.0
    [loss] = [c for c in changes if isinstance(c, BindingLost)
              and c.loss.cause is not LossCause.STOPPED]
    assert loss.identity == ident(4) and loss.loss.reason is Reason.STALE_EPOCH


def test_the_asyncio_supervisor_reports_a_takeover_well_before_its_deadline() -> None:
    async def main() -> float:
        store = AsyncInMemoryLeaseStore()
        feed = ManualNoticeFeed(NoticeConfirmer())
        coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        async with AsyncSupervisor(coordinator, notices=feed) as supervisor:
            changes = supervisor.changes()
            for i in range(20):
                supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
            started = 0
            async for change in changes:
                started += isinstance(change, BindingStarted)
                if started == 20:
                    break
            rival = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            assert (await rival.takeover(ident(4), "gw-b", scopes=SCOPES, ttl=TTL,
                                         expected_epoch=1)).ok
            began = wall_time.monotonic()
            # From another thread, as a listener calls it.
            await asyncio.to_thread(feed.send, ident(4), 2)
            async with asyncio.timeout(1.0):
                async for change in changes:
                    if isinstance(change, BindingLost):
                        assert change.identity == ident(4)
                        assert change.loss.reason is Reason.STALE_EPOCH
                        return wall_time.monotonic() - began
        raise AssertionError("the changes ended")

    assert asyncio.run(main()) < 1.0


def test_a_turn_nobody_can_make_is_given_back_at_once() -> None:
    # An asyncio supervisor driven by hand outside any loop cannot be woken from the
    # confirmer's thread: the turn ends at once, and nothing waits for a read.
    confirmer = NoticeConfirmer()
    feed = ManualNoticeFeed(confirmer)
    supervisor = AsyncSupervisor(AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(),
                                                                AllowAllPolicy()),
                                 background=False, notices=feed)
    supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=TTL)
    for _ in range(2):  # the first read, then the acquire
        asyncio.run(supervisor.turn())
    assert supervisor._core.schedule.slots[ident(0)].holding
    feed.send(ident(0), 3)
    eventually(lambda: confirmer.stats().confirmations == 1
               and not confirmer._gate.pending(ident(0)))
    slot = supervisor._core.schedule.slots[ident(0)]
    assert not slot.confirm and not supervisor._core.confirming
