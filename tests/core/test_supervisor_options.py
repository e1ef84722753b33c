"""The supervisor's options for a lease held as :func:`~mos_lease.hold` holds it: a binding
held once (its loss ends it), the held lease's local deadline, renewals through a
``heartbeat_coordinator``, and the keeper's telemetry (``on_event``), on the in-memory store
with fake time, both drivers turned by hand."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    LossCause,
    Reason,
    StoreUnavailable,
)
from mos_lease.events import Event, Lost, RenewalRetry, Renewed
from mos_lease.stats import SupervisorStats
from mos_lease.supervisor import AsyncSupervisor, BindingLost, BindingStarted, Supervisor
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.core.test_supervisor import SCOPES, TTL, AsyncRig, Rig, ident


class Renewer(ConnectorLeaseCoordinator):
    """A coordinator that counts the renewal batches made through it."""

    batches = 0

    def prime_heartbeat_many(self, leases: Sequence[LeaseHandle], **options: Any) -> Any:
        self.batches += 1
        return super().prime_heartbeat_many(leases, **options)


class AsyncRenewer(AsyncConnectorLeaseCoordinator):
    batches = 0

    async def heartbeat_many(self, leases: Sequence[LeaseHandle], **options: Any) -> Any:
        self.batches += 1
        return await super().heartbeat_many(leases, **options)


def test_a_binding_held_once_is_not_campaigned_for_after_its_loss() -> None:
    rig = Rig()
    rig.add(1, once=True)
    rig.supervisor.add(ident(1), "gw-a", scopes=SCOPES, ttl=TTL)  # campaigns again
    rig.settle()
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    for n in (0, 1):
        assert rival.takeover(ident(n), "gw-b", scopes=SCOPES, ttl=1,
                              expected_epoch=1).ok
    rig.store.reset()
    rig.run(60)  # the renewals are refused (stale epoch); the rival's leases expire at 1 s
    [lost] = rig.of(BindingLost, ident(0))
    assert lost.loss.cause is LossCause.DENIED
    # Ended: no read, no takeover of the expired lease, and no longer run.
    assert not rig.of(BindingStarted, ident(0))[1:]
    assert ident(0) not in rig.supervisor.bindings
    assert rig.supervisor.lease(ident(0)) is None  # asked about, it holds nothing
    assert rig.supervisor._core.schedule.loss(ident(0)) == lost.loss  # a grant's refusal
    row = rig.store.load(ident(0)).row
    assert row is not None and row.connector_id == "gw-b"
    # The other binding campaigned again and took its expired lease back.
    assert [c.lease.epoch for c in rig.of(BindingStarted, ident(1))] == [1, 3]
    assert rig.supervisor.remove(ident(0)) is None  # nothing left to release
    with pytest.raises(InvalidInput, match="is not supervised"):
        rig.supervisor.lease(ident(0))


def test_a_binding_held_once_ends_at_its_deadline_and_once_must_be_a_bool() -> None:
    rig = Rig()
    rig.add(1, once=True)
    rig.settle()
    rig.store.down = True
    rig.run(40)
    [lost] = rig.of(BindingLost, ident(0))
    assert lost.loss.cause is LossCause.DEADLINE
    rig.store.down = False
    rig.run(20)
    assert len(rig.of(BindingStarted)) == 1 and not rig.supervisor.bindings
    with pytest.raises(InvalidInput, match="once"):
        rig.supervisor.add(ident(5), "gw-a", scopes=SCOPES, ttl=TTL,
                           once="yes")  # type: ignore[arg-type]


def test_deadline_is_the_held_leases_local_deadline() -> None:
    rig = Rig()
    rig.add(1)
    assert rig.supervisor.deadline(ident(0)) is None  # campaigning
    rig.settle()
    held_at = rig.time.mono
    # ttl 30 s less the safety margin (3 s; no clock step over the in-memory store), from
    # the acquire.
    assert rig.supervisor.deadline(ident(0)) == pytest.approx(held_at + 27)
    rig.run(12)  # renewed at ~10 s: the deadline moves with it
    deadline = rig.supervisor.deadline(ident(0))
    assert deadline is not None and deadline > held_at + 30
    assert rig.supervisor.deadline(ident(9)) is None  # not run
    rig.supervisor.close()
    assert rig.supervisor.deadline(ident(0)) is None


def test_renewals_go_through_the_heartbeat_coordinator() -> None:
    rig = Rig()
    renewer = Renewer(rig.store, AllowAllPolicy(), monotonic_clock=rig.time)
    rig.supervisor.close()
    rig.supervisor = Supervisor(rig.coordinator, on_change=rig.changes.append,
                                clock=rig.time, sleep=rig.sleeps.append, random=lambda: 0.5,
                                background=False, heartbeat_coordinator=renewer)
    rig.add(3)
    rig.settle()
    rig.run(25)
    assert renewer.batches == 2 and rig.store.calls["renew_many"] == 2
    assert not rig.of(BindingLost)
    with pytest.raises(ConfigurationError, match="heartbeat_coordinator"):
        Supervisor(rig.coordinator, heartbeat_coordinator=AsyncConnectorLeaseCoordinator(
            AsyncInMemoryLeaseStore()))  # type: ignore[arg-type]


def test_renewal_batches_take_turns_over_two_heartbeat_coordinators() -> None:
    """Given two renewal coordinators, the batches of a tick go to each in turn, and the
    thread supervisor runs the two batches in flight at once (a renewal thread each): every
    store call here waits until the other one runs too, which one renewal thread at a time
    would never reach (its barrier breaks, the batch fails, and a lease is lost)."""
    rig = Rig()
    both = threading.Barrier(2, timeout=5)
    renewers = [Renewer(rig.store, AllowAllPolicy(), monotonic_clock=rig.time)
                for _ in range(2)]
    met: list[int] = []

    def meeting(renewer: Renewer) -> Any:
        prime = renewer.prime_heartbeat_many

        def primed(leases: Sequence[LeaseHandle], **options: Any) -> Any:
            rest = prime(leases, **options)

            def call() -> Any:
                met.append(both.wait())
                return rest()
            return call
        return primed

    for renewer in renewers:
        renewer.prime_heartbeat_many = meeting(renewer)  # type: ignore[method-assign]
    rig.supervisor.close()
    rig.supervisor = Supervisor(rig.coordinator, on_change=rig.changes.append,
                                clock=rig.time, sleep=rig.sleeps.append, random=lambda: 0.5,
                                background=False, heartbeat_coordinator=renewers)
    rig.add(2000)  # two batches of 1,000 per tick
    rig.settle()
    rig.run(25)  # two ticks
    assert [renewer.batches for renewer in renewers] == [2, 2]
    assert sorted(met) == [0, 0, 1, 1]  # both barriers passed by two threads each
    assert rig.supervisor._in_flight == 3  # one batch more than with one connection
    assert not rig.of(BindingLost)
    rig.supervisor.close()


def test_the_asyncio_supervisor_spreads_its_batches_over_two_heartbeat_coordinators() -> None:
    async def main() -> None:
        rig = AsyncRig(AsyncInMemoryLeaseStore)
        renewers = [AsyncRenewer(rig.store, AllowAllPolicy(), monotonic_clock=rig.time)
                    for _ in range(2)]

        async def sleep(seconds: float) -> None:
            rig.sleeps.append(seconds)

        supervisor = AsyncSupervisor(rig.coordinator, on_change=rig.changes.append,
                                     clock=rig.time, sleep=sleep, random=lambda: 0.5,
                                     background=False, heartbeat_coordinator=renewers)
        for i in range(1500):
            supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
        for _ in range(60):
            await supervisor.turn()
            rig.time.advance(0.5)
        assert [renewer.batches for renewer in renewers] == [2, 2]
        assert not [c for c in rig.changes if isinstance(c, BindingLost)]
        await supervisor.close()

    asyncio.run(main())


class Hanging:
    """Makes every renewal batch through a coordinator hang (until ``release``) once
    ``hang`` is set, as a statement on a half-open connection would; given ``bound``, each
    hung call raises after that many seconds, as a store's own call bound ends it (and the
    next call, on a new connection over the same silent network, hangs again)."""

    def __init__(self, bound: float = 30.0) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()
        self.bound = bound

    def wrap(self, renewer: Renewer) -> None:
        prime = renewer.prime_heartbeat_many

        def primed(leases: Sequence[LeaseHandle], **options: Any) -> Any:
            rest = prime(leases, **options)

            def call() -> Any:
                if self.hang.is_set() and not self.release.wait(self.bound):
                    raise StoreUnavailable("the call bound passed")
                return rest()
            return call
        renewer.prime_heartbeat_many = primed  # type: ignore[method-assign]


HUNG = 3000  # bindings of the hung-connection tests: three renewal batches a tick
FEW = 50  # and one batch a tick: no batch of the other coordinator runs beside it
HUNG_TTL = 3.0


def add_hung(supervisor: Supervisor | AsyncSupervisor, n: int) -> None:
    """The bindings of a hung-connection test, with a short ttl (a renewal every second,
    1.7 s from a renewal to its deadline: room for a slow machine's batch of 1,000)."""
    for i in range(n):
        supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=HUNG_TTL)


def all_started(changes: list[Any], n: int) -> bool:
    return sum(isinstance(c, BindingStarted) for c in changes) == n


async def all_started_soon(changes: list[Any], n: int) -> None:
    while not all_started(changes, n):
        await asyncio.sleep(0.01)


def none_lost(changes: list[Any], lease: Callable[[LeaseIdentity], LeaseHandle | None],
              n: int) -> None:
    """No binding was lost: the batches that hung (and those sent behind them) were given up
    on while their leases had time left, and renewed through the other coordinator."""
    assert [c.identity.logical_agent_id for c in changes if isinstance(c, BindingLost)] == []
    assert sum(lease(ident(i)) is not None for i in range(n)) == n


@pytest.mark.parametrize("n", [HUNG, FEW], ids=["three batches a tick", "one batch a tick"])
@pytest.mark.parametrize("bound", [30.0, 1.2], ids=["hung for good", "ended by a bound"])
def test_renewals_pass_over_a_heartbeat_coordinator_whose_batch_hangs(bound: float, n: int
                                                                      ) -> None:
    """A batch on one of two renewal coordinators that hangs is given up on at half the time
    its leases have left, and they are retried through the other; so is every batch sent
    to the hung one before that, and the batches waiting behind them are sent in time.
    Every later batch goes to the other coordinator while the hung one still runs, and for
    a pause after it ends (a store's call bound ends it, and the next one would hang
    again). No binding is lost; the old code lost 800-3,600 of 3,000-6,000 (those of the
    hung batches, and of the batches behind them, at their deadlines). Real time, a short
    ttl: a renewal every second, a batch's limit under two."""
    store = InMemoryLeaseStore()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    renewers = [Renewer(store, AllowAllPolicy()) for _ in range(2)]
    hanging = Hanging(bound)
    hanging.wrap(renewers[1])
    changes: list[Any] = []
    supervisor = Supervisor(coordinator, on_change=changes.append,
                            heartbeat_coordinator=renewers)
    try:
        add_hung(supervisor, n)
        deadline = time.monotonic() + 5
        while not all_started(changes, n) and time.monotonic() < deadline:
            time.sleep(0.01)
        hanging.hang.set()
        time.sleep(3 * HUNG_TTL)  # nine renewal ticks
        none_lost(changes, supervisor.lease, n)
        if n == FEW:  # renewed by a hedge: no batch of the other to be outpaced by
            assert supervisor.stats().renewal_hedges >= 1
    finally:
        hanging.release.set()
        supervisor.close()


def through_trouble(effects: Sequence[Callable[[], None]], ttl: float, watched: float
                    ) -> tuple[list[Any], int, SupervisorStats, list[int]]:
    """A thread supervisor keeping FEW bindings through two renewal coordinators; once both
    have renewed a batch (each was quick before), every call through coordinator ``k`` runs
    ``effects[k]`` first, for ``watched`` seconds. The changes meanwhile, the bindings held
    at the end, the stats and the calls each coordinator took meanwhile."""
    store = InMemoryLeaseStore()
    renewers = [Renewer(store, AllowAllPolicy()) for _ in effects]
    trouble = threading.Event()
    for renewer, effect in zip(renewers, effects, strict=True):
        prime = renewer.prime_heartbeat_many

        def primed(leases: Sequence[LeaseHandle], prime: Any = prime,
                   effect: Callable[[], None] = effect, **options: Any) -> Any:
            rest = prime(leases, **options)

            def call() -> Any:
                if trouble.is_set():
                    effect()
                return rest()
            return call
        renewer.prime_heartbeat_many = primed  # type: ignore[method-assign]
    changes: list[Any] = []
    supervisor = Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()),
                            on_change=changes.append, heartbeat_coordinator=renewers)
    try:
        for i in range(FEW):
            supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=ttl)
        deadline = time.monotonic() + 10
        while not (all_started(changes, FEW) and all(r.batches for r in renewers)) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        before = [r.batches for r in renewers]
        del changes[:]
        trouble.set()
        time.sleep(watched)
        held = sum(supervisor.lease(ident(i)) is not None for i in range(FEW))
        # A copy: closing reports every binding stopped, into the same list.
        return (list(changes), held, supervisor.stats(),
                [r.batches - b for r, b in zip(renewers, before, strict=True)])
    finally:
        trouble.clear()
        supervisor.close()


def lost(changes: list[Any]) -> list[LeaseIdentity]:
    return [c.identity for c in changes if isinstance(c, BindingLost)]


def test_two_heartbeat_coordinators_both_slow_are_waited_for_until_the_deadline() -> None:
    """Both renewal coordinators slow (the database is): every call takes 1.2 s, past half
    the time a renewal has (ttl 3 s: 1.7 s from the renewal to the deadline), but within it.
    Neither outpaces the other, so no batch is given up on before its deadline and no lease
    is lost; giving up at the half-time mark whatever the other did lost them all. Each
    coordinator was quick before the database turned slow, which is no evidence either:
    each batch is sent again on the idle one at half its time, and the first answer
    counts."""
    changes, held, stats, _ = through_trouble([lambda: time.sleep(1.2)] * 2, 3.0, 6.0)
    assert (lost(changes), held) == ([], FEW)
    assert stats.renewal_hedges >= 1  # each slow batch, sent again


def connection(seconds: float) -> Callable[[], None]:
    """A call that takes ``seconds`` on a connection of its own: one call at a time on it,
    as on a PostgreSQL connection (a call left running keeps the next one waiting)."""
    lock = threading.Lock()

    def call() -> None:
        with lock:
            time.sleep(seconds)
    return call


def test_no_batch_waits_behind_a_hedge_that_lost_and_a_slow_database_is_hedged_once(
        ) -> None:
    """Both renewal coordinators slow by 1.2 s (the database is), each on a connection that
    takes one call at a time (ttl 3 s: 1.7 s from a renewal to its deadline, the hedge sent
    at 0.85 s). The first hedge loses to the call it hedged and runs on, and its connection
    is taken until it ends: the next batch goes to the other connection (sent behind it, it
    missed its deadline and every lease was lost), and no batch is hedged again while none
    returns within its patience (every batch was hedged, twice the work for a slow
    database)."""
    changes, held, stats, calls = through_trouble([connection(1.2), connection(1.2)], 3.0,
                                                   6.0)
    assert (lost(changes), held) == ([], FEW)
    assert stats.renewal_hedges == 1
    assert sum(calls) <= stats.renewal_ticks + 1


def bounded_call() -> None:
    """A call a store's call bound ends (a hung statement)."""
    time.sleep(2.4)
    raise StoreUnavailable("the call bound passed")


def test_a_hedge_still_running_when_the_first_call_fails_is_waited_for() -> None:
    """One coordinator's calls fail after 2.4 s (a store's call bound ends a hung statement),
    the other's take 1.2 s (ttl 6 s: 3.4 s from a renewal to its deadline, the hedge sent at
    1.7 s). A batch on the first is sent again on the second at half its time; the first
    fails before the hedge returns, and the hedge's results still count, renewing every
    lease. Taking the failure as the batch's outcome retried the leases on the second
    behind the hedge still running there, past their deadline (3.65 s): every lease lost."""
    changes, held, _, calls = through_trouble([lambda: time.sleep(1.2), bounded_call], 6.0,
                                              8.0)
    assert calls[1] >= 1  # a batch met the failing coordinator
    assert (lost(changes), held) == ([], FEW)


async def through_trouble_async(effects: Sequence[Callable[[], Awaitable[None]]], ttl: float,
                                watched: float) -> tuple[list[Any], int, SupervisorStats]:
    """:func:`through_trouble` for the asyncio supervisor."""
    trouble = asyncio.Event()

    class Troubled(AsyncRenewer):
        effect: Callable[[], Awaitable[None]]

        async def heartbeat_many(self, leases: Sequence[LeaseHandle], **options: Any) -> Any:
            if trouble.is_set():
                await self.effect()
            return await super().heartbeat_many(leases, **options)

    store = AsyncInMemoryLeaseStore()
    renewers = []
    for effect in effects:
        renewer = Troubled(store, AllowAllPolicy())
        renewer.effect = effect
        renewers.append(renewer)
    changes: list[Any] = []
    supervisor = AsyncSupervisor(AsyncConnectorLeaseCoordinator(store, AllowAllPolicy()),
                                 on_change=changes.append, heartbeat_coordinator=renewers)
    try:
        for i in range(FEW):
            supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=ttl)

        async def warm() -> None:
            while not (all_started(changes, FEW) and all(r.batches for r in renewers)):
                await asyncio.sleep(0.01)
        await asyncio.wait_for(warm(), 10)
        del changes[:]
        trouble.set()
        await asyncio.sleep(watched)
        held = sum(supervisor.lease(ident(i)) is not None for i in range(FEW))
        return list(changes), held, supervisor.stats()
    finally:
        trouble.clear()
        await supervisor.close()


async def bounded_call_async() -> None:
    await asyncio.sleep(2.4)
    raise StoreUnavailable("the call bound passed")


def test_the_asyncio_supervisor_waits_for_a_hedge_still_running_when_the_first_fails(
        ) -> None:
    """As above for the asyncio supervisor."""
    changes, held, stats = asyncio.run(through_trouble_async(
        [lambda: asyncio.sleep(1.2), bounded_call_async], 6.0, 8.0))
    assert (lost(changes), held) == ([], FEW)
    assert stats.renewal_hedges >= 1


def test_the_asyncio_supervisor_waits_for_two_heartbeat_coordinators_both_slow() -> None:
    """As above for the asyncio supervisor: each batch, sent again on the idle coordinator at
    half its time, is answered by the first call (the second is cancelled), and no lease is
    lost."""
    changes, held, stats = asyncio.run(through_trouble_async(
        [lambda: asyncio.sleep(1.2)] * 2, 3.0, 6.0))
    assert (lost(changes), held) == ([], FEW)
    assert stats.renewal_hedges >= 1


def connection_async(seconds: float) -> Callable[[], Awaitable[None]]:
    """:func:`connection` for the asyncio supervisor; a call cancelled keeps its connection
    until its statement ends, as psycopg waits for the server to end a cancelled one."""
    lock = asyncio.Lock()

    async def call() -> None:
        async with lock:
            statement = asyncio.ensure_future(asyncio.sleep(seconds))
            try:
                await asyncio.shield(statement)
            except asyncio.CancelledError:
                await statement
                raise
    return call


def test_the_asyncio_supervisor_sends_no_batch_behind_a_hedge_that_lost() -> None:
    """As above for the asyncio supervisor."""
    changes, held, stats = asyncio.run(through_trouble_async(
        [connection_async(1.2), connection_async(1.2)], 3.0, 6.0))
    assert (lost(changes), held) == ([], FEW)
    assert stats.renewal_hedges == 1


@pytest.mark.parametrize("n", [HUNG, FEW], ids=["three batches a tick", "one batch a tick"])
def test_the_asyncio_supervisor_passes_over_a_heartbeat_coordinator_whose_batch_hangs(
        n: int) -> None:
    """As above for the asyncio supervisor, whose batch given up on is cancelled: one whose
    connection will not let the cancellation end it (it waits on) counts as hung until it
    ends."""
    hang, release = asyncio.Event(), asyncio.Event()

    class Stuck(AsyncRenewer):
        async def heartbeat_many(self, leases: Sequence[LeaseHandle], **options: Any) -> Any:
            if hang.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()
                await release.wait()
            return await super().heartbeat_many(leases, **options)

    async def main() -> None:
        store = AsyncInMemoryLeaseStore()
        coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        renewers = [AsyncRenewer(store, AllowAllPolicy()), Stuck(store, AllowAllPolicy())]
        changes: list[Any] = []
        supervisor = AsyncSupervisor(coordinator, on_change=changes.append,
                                     heartbeat_coordinator=renewers)
        try:
            add_hung(supervisor, n)
            await asyncio.wait_for(all_started_soon(changes, n), 5)
            hang.set()
            await asyncio.sleep(3 * HUNG_TTL)
            none_lost(changes, supervisor.lease, n)
            if n == FEW:
                assert supervisor.stats().renewal_hedges >= 1
        finally:
            release.set()
            await supervisor.close()

    asyncio.run(main())


@pytest.mark.parametrize("given", ["three", "twice", "empty", "a string", "a wrong kind"])
def test_heartbeat_coordinators_are_one_or_two_distinct_coordinators(given: str) -> None:
    rig = Rig()
    renewers = [Renewer(rig.store, AllowAllPolicy()) for _ in range(3)]
    bad: object = {"three": renewers, "twice": [renewers[0], renewers[0]], "empty": [],
                   "a string": "renewer",
                   "a wrong kind": [renewers[0], AsyncConnectorLeaseCoordinator(
                       AsyncInMemoryLeaseStore())]}[given]
    with pytest.raises(ConfigurationError, match="heartbeat_coordinator"):
        Supervisor(rig.coordinator, heartbeat_coordinator=bad,  # type: ignore[arg-type]
                   background=False)


def test_the_asyncio_supervisor_renews_through_the_heartbeat_coordinator() -> None:
    async def main() -> None:
        rig = AsyncRig(AsyncInMemoryLeaseStore)
        renewer = AsyncRenewer(rig.store, AllowAllPolicy(), monotonic_clock=rig.time)

        async def sleep(seconds: float) -> None:
            rig.sleeps.append(seconds)

        supervisor = AsyncSupervisor(rig.coordinator, on_change=rig.changes.append,
                                     clock=rig.time, sleep=sleep, random=lambda: 0.5,
                                     background=False, heartbeat_coordinator=renewer)
        supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=TTL)
        for _ in range(60):
            await supervisor.turn()
            rig.time.advance(0.5)
        assert renewer.batches == 2
        assert not [c for c in rig.changes if isinstance(c, BindingLost)]
        await supervisor.close()

    asyncio.run(main())


def test_on_event_reports_renewals_retries_and_losses_as_a_keepers() -> None:
    rig = Rig()
    seen: list[Event] = []
    rig.supervisor.close()
    rig.supervisor = Supervisor(rig.coordinator, on_change=rig.changes.append,
                                clock=rig.time, sleep=rig.sleeps.append, random=lambda: 0.5,
                                background=False, on_event=seen.append)
    rig.add(2)
    rig.settle()
    rig.run(11)  # one renewal tick
    renewed = [e for e in seen if isinstance(e, Renewed)]
    assert sorted(e.logical_agent_id for e in renewed) == ["agent-0", "agent-1"]
    assert all(e.epoch == 1 and e.connector_id == "gw-a" for e in renewed)
    seen.clear()
    rig.store.down = True
    rig.run(10)
    retries = [e for e in seen if isinstance(e, RenewalRetry)]
    assert retries and all(e.cause == "StoreUnavailable" for e in retries)
    assert [e.attempt for e in retries if e.logical_agent_id == "agent-0"][:2] == [1, 2]
    assert all(e.delay > 0 for e in retries)
    seen.clear()
    rig.run(20)  # past the deadline
    lost = [e for e in seen if isinstance(e, Lost)]
    assert sorted((e.logical_agent_id, e.cause, e.reason) for e in lost) == [
        ("agent-0", "deadline", Reason.LEASE_EXPIRED),
        ("agent-1", "deadline", Reason.LEASE_EXPIRED)]
    rig.store.down = False
    rig.run(5)
    assert len(rig.of(BindingStarted)) == 4


def test_a_failing_on_event_hook_stops_nothing() -> None:
    rig = Rig()
    rig.supervisor.close()

    def broken(event: Event) -> None:
        raise RuntimeError("exporter down")

    rig.supervisor = Supervisor(rig.coordinator, on_change=rig.changes.append,
                                clock=rig.time, sleep=rig.sleeps.append, random=lambda: 0.5,
                                background=False, on_event=broken)
    rig.add(2)
    rig.run(40)
    assert len(rig.of(BindingStarted)) == 2 and not rig.of(BindingLost)
    with pytest.raises(ConfigurationError, match="on_event"):
        Supervisor(rig.coordinator, on_event=42)  # type: ignore[arg-type]


def test_the_memory_store_supervisor_is_untouched_without_the_options() -> None:
    # No hook: the schedule keeps no telemetry at all.
    supervisor = Supervisor(ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy()),
                            background=False)
    assert supervisor._core.schedule.telemetry is None
    supervisor.close()


def test_a_lease_won_by_hand_is_kept_from_the_start_of_the_call_that_won_it() -> None:
    rig = Rig()
    obtained_at = rig.time.mono
    won = rig.coordinator.acquire(ident(0), "gw-a", scopes=SCOPES, ttl=TTL)
    assert won.lease is not None
    rig.time.advance(2)  # the call took a while: the deadline still counts from its start
    rig.store.reset()
    rig.supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=TTL, once=True, held=won.lease,
                       obtained_at=obtained_at)
    assert [c.lease for c in rig.of(BindingStarted)] == [won.lease]
    assert rig.supervisor.lease(ident(0)) == won.lease
    assert rig.supervisor.deadline(ident(0)) == pytest.approx(obtained_at + 27)
    rig.run(30)  # renewed, without a campaign first (no read, no acquire)
    assert set(rig.store.calls) == {"renew_many"}
    assert len(rig.of(BindingStarted)) == 1 and not rig.of(BindingLost)


def test_a_lease_won_by_hand_is_checked_before_anything_is_kept() -> None:
    rig = Rig()
    won = rig.coordinator.acquire(ident(0), "gw-a", scopes=SCOPES, ttl=TTL).lease
    assert won is not None
    for held, obtained_at, connector, field in (
            (won, None, "gw-a", "obtained_at"), (None, 1.0, "gw-a", "held"),
            (won, 1.0, "gw-b", "held"), ("lease", 1.0, "gw-a", "held"),
            (won, float("nan"), "gw-a", "obtained_at")):
        with pytest.raises(InvalidInput, match=field):
            rig.supervisor.add(ident(0), connector, scopes=SCOPES, ttl=TTL,
                               held=held, obtained_at=obtained_at)  # type: ignore[arg-type]
    assert not rig.supervisor.bindings and not rig.changes


def test_turned_by_hand_then_started_it_keeps_the_lease_on_real_waits() -> None:
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    injected: list[float] = []
    supervisor = Supervisor(coordinator, sleep=injected.append, background=False)
    supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=1.2, once=True)
    while supervisor.lease(ident(0)) is None:  # the wait, in the caller's thread
        supervisor.turn()
    first = supervisor.lease(ident(0))
    assert first is not None
    slept = len(injected)
    supervisor.start(name="mos-lease-holder acme/agent-0/b")
    supervisor.start()  # running already: no second thread
    try:
        time.sleep(1.5)  # renewed every 0.4 s; the deadline is about 1.1 s
        lease = supervisor.lease(ident(0))
        assert lease is not None and lease.epoch == 1 and lease.expires_at > first.expires_at
        assert len(injected) == slept  # the real waits took over
        names = [t.name for t in threading.enumerate()]
        assert names.count("mos-lease-holder acme/agent-0/b") == 1
        assert "mos-lease-supervisor" not in names
    finally:
        supervisor.close()
    with pytest.raises(ConfigurationError, match="closed"):
        supervisor.start()


def test_an_asyncio_supervisor_turned_by_hand_then_started_runs_as_a_named_task() -> None:
    async def main() -> None:
        coordinator = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(),
                                                     AllowAllPolicy())
        injected: list[float] = []

        async def sleep(seconds: float) -> None:
            injected.append(seconds)

        supervisor = AsyncSupervisor(coordinator, sleep=sleep, background=False)
        supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=1.2, once=True)
        while supervisor.lease(ident(0)) is None:
            await supervisor.turn()
        first = supervisor.lease(ident(0))
        assert first is not None
        slept = len(injected)
        supervisor.start(name="mos-lease-holder acme/agent-0/b")
        try:
            await asyncio.sleep(1.5)
            lease = supervisor.lease(ident(0))
            assert lease is not None and lease.expires_at > first.expires_at
            assert len(injected) == slept
            assert "mos-lease-holder acme/agent-0/b" in {
                t.get_name() for t in asyncio.all_tasks()}
        finally:
            await supervisor.close()

    asyncio.run(main())
