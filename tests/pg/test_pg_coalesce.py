"""Coalesced reads (mos_lease_pg.coalesce): loads that overlap on one store share one round
trip, and each caller is told exactly what a lone load would tell it.

The overlap is made deterministic: the first load (the one that goes out alone) is held at
the store's sending step until the loads meant to queue behind it have queued. Every load
statement the store sends is recorded by name (``load.sql``, ``load_many.sql``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    LeaseIdentity,
    StoreUnavailable,
    ValidationResult,
)
from mos_lease.vocabulary import LifecycleEvent, Reason
from mos_lease_pg import ConnectionSettings, statements
from mos_lease_pg.coalesce import MAX_BATCH, Reads, Ticket
from tests.pg import held_sends
from tests.pg_clock import ShiftedAsyncPostgresLeaseStore, ShiftedPostgresLeaseStore
from tests.pg_fixtures import StoreFactory

LOADS = ("load.sql", "load_many.sql")
SCOPES = ["tool:run"]
HOLD = 10.0  # the longest a test holds the first load (a failing test ends, never hangs)


def _until(condition: Callable[[], bool], limit: float = HOLD) -> None:
    ends = time.monotonic() + limit
    while not condition():
        if time.monotonic() > ends:
            raise AssertionError("condition not reached")
        time.sleep(0.002)


class Recorder:
    """The load statements a store sent (name, keys), the first held until ``release``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.release = threading.Event()
        self.fail_many: BaseException | None = None

    def note(self, call: Any) -> bool:
        """Record ``call``; whether it is the first load (to be held)."""
        name = call.statement.name
        if name not in LOADS:
            return False
        keys = len(call.params["tenant_ids"]) if name == "load_many.sql" else 1
        self.sent.append((name, keys))
        return len(self.sent) == 1

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.sent]


async def _until_async(condition: Callable[[], bool], limit: float = HOLD) -> None:
    ends = time.monotonic() + limit
    while not condition():
        if time.monotonic() > ends:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)


def hold_sync(store: ShiftedPostgresLeaseStore) -> Recorder:
    recorder = Recorder()
    return held_sends.hold_sync(
        store, recorder, hold=HOLD,
        fail=lambda call: recorder.fail_many if call.statement.name == "load_many.sql"
        else None)


def hold_async(store: ShiftedAsyncPostgresLeaseStore) -> Recorder:
    return held_sends.hold_async(store, Recorder(), hold=HOLD)


def queued(store: Any) -> int:
    return len(store._reads._reads.waiting)


# --- the rules, without I/O ---------------------------------------------------------------


def _ticket(n: int = 0) -> Ticket:
    return Ticket(LeaseIdentity("t", f"a{n}", "b"), 1.0)


def test_a_load_goes_alone_only_when_nothing_is_in_flight() -> None:
    reads: Reads[Ticket] = Reads()
    assert reads.alone()
    assert not reads.alone()  # in flight: the next one queues
    assert not reads.returned()  # nothing queued: idle again
    assert reads.alone()


def test_what_queued_behind_a_lone_load_is_one_batch_and_a_withdrawn_load_is_left_out() -> None:
    reads: Reads[Ticket] = Reads()
    assert reads.alone()
    first, second, third = _ticket(1), _ticket(2), _ticket(3)
    reads.waiting += [first, second, third]
    reads.withdraw(second)
    assert reads.returned()  # loads wait: the store stays busy for the pump
    assert not reads.alone()
    assert reads.take() == [first, third]
    reads.withdraw(first)  # sent already: nothing to remove
    assert reads.take() is None
    assert reads.alone()  # idle again


def test_a_batch_carries_at_most_max_batch_keys() -> None:
    reads: Reads[Ticket] = Reads()
    reads.alone()
    reads.waiting += [_ticket(i) for i in range(MAX_BATCH + 3)]
    first = reads.take()
    assert first is not None and len(first) == MAX_BATCH
    rest = reads.take()
    assert rest is not None and len(rest) == 3


def test_an_abandoned_queue_fails_every_waiting_load_and_leaves_the_store_idle() -> None:
    reads: Reads[Ticket] = Reads()
    reads.alone()
    waiting = [_ticket(1), _ticket(2)]
    reads.waiting += waiting
    error = StoreUnavailable("gone")
    assert reads.abandon(error) == waiting
    assert all(t.error is error for t in waiting)
    assert reads.alone()


# --- the statement ------------------------------------------------------------------------


def test_load_many_reads_each_key_as_load_does_in_order_at_one_time(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    held = [LeaseIdentity(pg_tenant, f"a{i}", "b") for i in range(3)]
    for n, identity in enumerate(held):  # one of them with holder metadata, read back too
        metadata = {"endpoint": f"http://gw-{n}:8080"} if n == 1 else None
        assert gateway.acquire(identity, "c1", scopes=SCOPES, ttl=60, metadata=metadata).ok
    missing = LeaseIdentity(pg_tenant, "nobody", "b")
    keys = [held[2], missing, held[0], held[2], held[1]]
    snapshots = store._run(statements.load_many(keys, store._offset))
    assert len(snapshots) == len(keys)
    assert len({s.now for s in snapshots}) == 1
    for identity, snapshot in zip(keys, snapshots, strict=True):
        alone = store._run(statements.load(identity, store._offset))
        assert snapshot.row == alone.row
        assert alone.now >= snapshot.now
    assert snapshots[4].row is not None
    assert snapshots[4].row.metadata == {"endpoint": "http://gw-1:8080"}


# --- the sync store: threads --------------------------------------------------------------


def test_a_lone_load_is_the_ordinary_statement_and_starts_no_pump(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    recorder = hold_sync(store)
    recorder.release.set()
    store.load(LeaseIdentity(pg_tenant, "a", "b"))
    store.load(LeaseIdentity(pg_tenant, "a", "b"))
    assert recorder.names == ["load.sql", "load.sql"]
    assert store._reads._pump is None


def _sync_cases(store: ShiftedPostgresLeaseStore, tenant: str
                ) -> tuple[ConnectorLeaseCoordinator,
                           list[tuple[str, ExecutionGrant, LeaseIdentity, list[str]]]]:
    """(name, grant, identity, scopes) of every kind of answer a validation gives."""
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    other = ConnectorLeaseCoordinator(store, AllowAllPolicy())

    def lease(name: str, ttl: float = 120) -> Any:
        acquired = gateway.acquire(LeaseIdentity(tenant, name, "main"), "c1",
                                   scopes=["tool:run", "tool:read"], ttl=ttl)
        assert acquired.lease is not None
        return acquired.lease

    def grant(handle: Any, via: ConnectorLeaseCoordinator = gateway,
              scopes: list[str] | None = None) -> ExecutionGrant:
        granted = via.issue_grant(handle, scopes=scopes or SCOPES, ttl=20)
        assert granted.grant is not None
        return granted.grant

    expired = lease("expired", ttl=60)
    expired_grant = grant(expired)
    store.advance(timedelta(seconds=30))  # the grant above runs out; those below do not
    cases = []
    for i in range(3):
        handle = lease(f"valid-{i}")
        cases.append((f"valid-{i}", grant(handle), handle.identity, SCOPES))
    cases.append(("expired", expired_grant, expired.identity, SCOPES))
    stale = lease("stale")
    stale_grant = grant(stale)
    assert gateway.takeover(stale.identity, "c2", scopes=SCOPES, ttl=60,
                            expected_epoch=1).ok
    cases.append(("stale", stale_grant, stale.identity, SCOPES))
    released = lease("released")
    released_grant = grant(released)
    assert gateway.release(released).ok
    cases.append(("released", released_grant, released.identity, SCOPES))
    scoped = lease("scopes")
    cases.append(("scopes", grant(scoped), scoped.identity, ["tool:read"]))
    unknown = lease("unknown")
    cases.append(("unknown", grant(unknown, via=other), unknown.identity, SCOPES))
    mismatch = lease("mismatch")
    cases.append(("binding", grant(mismatch), LeaseIdentity(tenant, "mismatch", "other"),
                  SCOPES))
    return gateway, cases


EXPECTED = {"valid-0": None, "valid-1": None, "valid-2": None,
            "expired": Reason.GRANT_EXPIRED, "stale": Reason.STALE_EPOCH,
            "released": Reason.LEASE_RELEASED, "scopes": Reason.SCOPE_NOT_AUTHORIZED,
            "unknown": Reason.GRANT_UNKNOWN, "binding": Reason.BINDING_MISMATCH}


def _answer(result: ValidationResult) -> tuple[Any, ...]:
    context = result.context
    return (result.reason, None if context is None else
            (context.epoch, context.lease_id, context.scopes, context.expires_at))


def _later(call: Callable[[], Any]) -> Any:
    time.sleep(0.05)  # after the first load went out alone
    return call()


def _denials(store: Any, identity: LeaseIdentity) -> int:
    return sum(1 for r in store.audit(identity)
               if r.entry.event is LifecycleEvent.GRANT_VALIDATE)


def _threads(calls: list[Callable[[], Any]]) -> tuple[list[threading.Thread], list[Any]]:
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as error:  # judged by the caller
            out[i] = error

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    return threads, out


def test_overlapping_validations_share_a_round_trip_and_each_gets_its_lone_answer(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    gateway, cases = _sync_cases(store, pg_tenant)
    recorder = hold_sync(store)
    recorder.release.set()
    lone = {name: _answer(gateway.validate(g, identity=i, scopes=s))
            for name, g, i, s in cases}
    assert {name: answer[0] for name, answer in lone.items()} == EXPECTED
    # The validations that read the store (the others are refused before the read).
    reading = len(recorder.sent)
    assert reading >= 6
    denied_before = {name: _denials(store, i) for name, _g, i, _s in cases}
    recorder.sent.clear()
    recorder.release.clear()
    def validation(grant: ExecutionGrant, identity: LeaseIdentity,
                   scopes: list[str]) -> Callable[[], ValidationResult]:
        return lambda: gateway.validate(grant, identity=identity, scopes=scopes)

    threads, out = _threads([validation(g, i, s) for _n, g, i, s in cases])
    _until(lambda: queued(store) == reading - 1)
    recorder.release.set()
    for thread in threads:
        thread.join(HOLD)
    assert {name: _answer(result) for (name, *_), result in zip(cases, out, strict=True)} \
        == lone
    # One lone load, then everything that queued behind it in one statement.
    assert recorder.sent == [("load.sql", 1), ("load_many.sql", reading - 1)]
    for name, _g, identity, _s in cases:  # each denial wrote its own audit row again
        assert _denials(store, identity) == denied_before[name] + (EXPECTED[name] is not None)


def test_a_takeover_committed_after_a_queued_validation_began_is_seen_by_it(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    rival = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    first = gateway.acquire(LeaseIdentity(pg_tenant, "first", "b"), "c1", scopes=SCOPES,
                            ttl=60).lease
    target = gateway.acquire(LeaseIdentity(pg_tenant, "target", "b"), "c1", scopes=SCOPES,
                             ttl=60).lease
    assert first is not None and target is not None
    first_grant = gateway.issue_grant(first, scopes=SCOPES, ttl=20).grant
    target_grant = gateway.issue_grant(target, scopes=SCOPES, ttl=20).grant
    assert first_grant is not None and target_grant is not None
    recorder = hold_sync(store)
    threads, out = _threads([
        lambda: gateway.validate(first_grant, identity=first.identity, scopes=SCOPES),
        lambda: _later(lambda: gateway.validate(target_grant, identity=target.identity,
                                                scopes=SCOPES))])
    _until(lambda: queued(store) == 1)  # the target's validation began, its load queued
    assert rival.takeover(target.identity, "c2", scopes=SCOPES, ttl=60,
                          expected_epoch=1).ok
    recorder.release.set()
    for thread in threads:
        thread.join(HOLD)
    assert out[0].ok
    assert out[1].reason is Reason.STALE_EPOCH
    assert recorder.names == ["load.sql", "load.sql"]  # a batch of one: the plain load


def test_a_validation_whose_bound_passes_while_queued_fails_closed_in_its_bound(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    bound = 0.6
    store = pg_stores(settings=ConnectionSettings(call_timeout=bound))
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    leases = [gateway.acquire(LeaseIdentity(pg_tenant, f"a{i}", "b"), "c1", scopes=SCOPES,
                              ttl=60).lease for i in range(2)]
    grants = [g for lease in leases if lease is not None
              for g in [gateway.issue_grant(lease, scopes=SCOPES, ttl=20).grant]
              if g is not None]
    assert len(grants) == 2
    recorder = hold_sync(store)
    ended: list[float] = []

    def queued_validation() -> ValidationResult:
        time.sleep(0.05)
        began = time.monotonic()
        result = gateway.validate(grants[1], identity=grants[1].identity, scopes=SCOPES)
        ended.append(time.monotonic() - began)
        return result

    threads, out = _threads([
        lambda: gateway.validate(grants[0], identity=grants[0].identity, scopes=SCOPES),
        queued_validation])
    _until(lambda: queued(store) == 1)
    threads[1].join(HOLD)
    assert out[1].reason is Reason.STORE_UNAVAILABLE
    assert bound * 0.9 <= ended[0] <= bound + 0.5
    assert queued(store) == 0  # withdrawn: it is not sent after it gave up
    recorder.release.set()
    threads[0].join(HOLD)
    assert recorder.names == ["load.sql"]


def test_a_failed_shared_statement_is_each_callers_own_failure(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    recorder = hold_sync(store)
    recorder.fail_many = StoreUnavailable("load failed: injected")
    keys = [LeaseIdentity(pg_tenant, f"a{i}", "b") for i in range(4)]
    def loader(key: LeaseIdentity) -> Callable[[], Any]:
        return lambda: store.load(key)

    threads, out = _threads([loader(k) for k in keys])
    _until(lambda: queued(store) == 3)
    recorder.release.set()
    for thread in threads:
        thread.join(HOLD)
    failed = [o for o in out if isinstance(o, BaseException)]
    assert len(failed) == 3  # the lone load succeeded; the three queued share the failure
    assert all(type(e) is StoreUnavailable and str(e) == "load failed: injected"
               for e in failed)
    assert len({id(e) for e in failed}) == 3  # each raised its own copy
    assert all(e.__cause__ is recorder.fail_many for e in failed)
    assert store.load(keys[0]).row is None  # and the store goes on


# --- the asyncio store: tasks -------------------------------------------------------------


@pytest.fixture
def async_store(pg_dsn: str) -> Iterator[Callable[..., ShiftedAsyncPostgresLeaseStore]]:
    def make(**options: Any) -> ShiftedAsyncPostgresLeaseStore:
        return ShiftedAsyncPostgresLeaseStore(pg_dsn, **options)

    yield make


def test_overlapping_asyncio_validations_share_a_round_trip(
        async_store: Callable[..., ShiftedAsyncPostgresLeaseStore], pg_tenant: str) -> None:
    async def main() -> None:
        async with async_store() as store:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            grants = []
            for i in range(6):
                lease = (await gateway.acquire(LeaseIdentity(pg_tenant, f"a{i}", "b"), "c1",
                                               scopes=SCOPES, ttl=60)).lease
                assert lease is not None
                grant = (await gateway.issue_grant(lease, scopes=SCOPES, ttl=20)).grant
                assert grant is not None
                grants.append(grant)
            lone = [_answer(await gateway.validate(g, identity=g.identity, scopes=SCOPES))
                    for g in grants]
            recorder = hold_async(store)
            tasks = [asyncio.create_task(gateway.validate(g, identity=g.identity,
                                                          scopes=SCOPES)) for g in grants]
            await _until_async(lambda: queued(store) >= 5)
            recorder.release.set()
            assert [_answer(r) for r in await asyncio.gather(*tasks)] == lone
            assert recorder.sent == [("load.sql", 1), ("load_many.sql", 5)]

    asyncio.run(main())


@pytest.mark.parametrize("cancelled", ["queued", "lone"])
def test_a_cancelled_caller_is_cancelled_and_the_others_are_answered(
        async_store: Callable[..., ShiftedAsyncPostgresLeaseStore], pg_tenant: str,
        cancelled: str) -> None:
    async def main() -> None:
        async with async_store() as store:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            grants = []
            for i in range(4):
                lease = (await gateway.acquire(LeaseIdentity(pg_tenant, f"a{i}", "b"), "c1",
                                               scopes=SCOPES, ttl=60)).lease
                assert lease is not None
                grant = (await gateway.issue_grant(lease, scopes=SCOPES, ttl=20)).grant
                assert grant is not None
                grants.append(grant)
            recorder = hold_async(store)
            tasks = [asyncio.create_task(gateway.validate(grants[0], identity=grants[0].identity,
                                                          scopes=SCOPES))]
            await _until_async(lambda: bool(recorder.sent))
            tasks += [asyncio.create_task(gateway.validate(g, identity=g.identity,
                                                           scopes=SCOPES)) for g in grants[1:]]
            await _until_async(lambda: queued(store) >= 3)
            victim = tasks[0] if cancelled == "lone" else tasks[2]
            victim.cancel()
            await asyncio.wait([victim])
            assert victim.cancelled()  # raised on, never swallowed
            recorder.release.set()
            others = [t for t in tasks if t is not victim]
            results = await asyncio.gather(*others)
            assert all(r.ok for r in results)
            keys = 2 if cancelled == "queued" else 3
            assert ("load_many.sql", keys) in recorder.sent

    asyncio.run(main())


def test_an_asyncio_validation_whose_bound_passes_while_queued_fails_closed(
        async_store: Callable[..., ShiftedAsyncPostgresLeaseStore], pg_tenant: str) -> None:
    bound = 0.6

    async def main() -> None:
        async with async_store(settings=ConnectionSettings(call_timeout=bound)) as store:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            grants = []
            for i in range(2):
                lease = (await gateway.acquire(LeaseIdentity(pg_tenant, f"a{i}", "b"), "c1",
                                               scopes=SCOPES, ttl=60)).lease
                assert lease is not None
                grant = (await gateway.issue_grant(lease, scopes=SCOPES, ttl=20)).grant
                assert grant is not None
                grants.append(grant)
            recorder = hold_async(store)
            lone = asyncio.create_task(gateway.validate(grants[0], identity=grants[0].identity,
                                                        scopes=SCOPES))
            await _until_async(lambda: bool(recorder.sent))
            began = time.monotonic()
            result = await gateway.validate(grants[1], identity=grants[1].identity,
                                            scopes=SCOPES)
            elapsed = time.monotonic() - began
            assert result.reason is Reason.STORE_UNAVAILABLE
            assert bound * 0.9 <= elapsed <= bound + 0.5
            assert queued(store) == 0
            recorder.release.set()
            await lone
            assert recorder.names == ["load.sql"]

    asyncio.run(main())
