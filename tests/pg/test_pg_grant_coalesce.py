"""Coalesced grant issue: grants issued at once in one process share the statement (and the
commit) of their audit rows, and each is judged, audited and answered as it would be alone.

The overlap is made deterministic: the first audit append (the one that goes out alone) is
held at the store's sending step until the appends meant to queue behind it have queued.
Every load and audit statement the store sends is recorded by name and key count.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    GrantResult,
    LeaseHandle,
    LeaseIdentity,
    StoreUnavailable,
)
from mos_lease.errors import InternalInconsistency
from mos_lease.ids import uuid7
from mos_lease.records import AuditEntry
from mos_lease.supervisor import AsyncSupervisor, BindingStarted
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason
from mos_lease_pg import ConnectionSettings
from tests.pg import held_sends
from tests.pg_clock import ShiftedAsyncPostgresLeaseStore, ShiftedPostgresLeaseStore
from tests.pg_fixtures import StoreFactory

SCOPES = ["tool:run"]
T = TypeVar("T")
HOLD = 10.0  # the longest a test holds the first append (a failing test ends, never hangs)
KEYS = {"load.sql": None, "load_many.sql": "tenant_ids", "record.sql": None,
        "record_many.sql": "event_ids"}


class Recorder:
    """The load and audit statements a store sent (name, keys); the first ``record.sql``
    held until ``release`` is set."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.release = threading.Event()
        self.held = False

    def note(self, call: Any) -> bool:
        """Record ``call``; whether it is the first lone append (to be held)."""
        name = call.statement.name
        if name not in KEYS:
            return False
        column = KEYS[name]
        self.sent.append((name, 1 if column is None else len(call.params[column])))
        if name == "record.sql" and not self.held:
            self.held = True
            return True
        return False

    def of(self, *names: str) -> list[tuple[str, int]]:
        return [(name, keys) for name, keys in self.sent if name in names]


def hold_sync(store: ShiftedPostgresLeaseStore) -> Recorder:
    return held_sends.hold_sync(store, Recorder(), hold=HOLD)


def hold_async(store: ShiftedAsyncPostgresLeaseStore) -> Recorder:
    return held_sends.hold_async(store, Recorder(), hold=HOLD)


def appends_queued(store: Any) -> int:
    return len(store._records._reads.waiting)

async def _grants_queued(gateway: AsyncConnectorLeaseCoordinator,
                         store: ShiftedAsyncPostgresLeaseStore, tenant: str
                         ) -> tuple[list[LeaseHandle], Recorder,
                                    list[asyncio.Task[GrantResult]]]:
    """Five leases, and a grant issue started for each: the first append held at the
    store's sending step, the other four queued behind it."""
    leases = []
    for i in range(5):
        lease = (await gateway.acquire(LeaseIdentity(tenant, f"a{i}", "b"), "c1",
                                       scopes=SCOPES, ttl=60)).lease
        assert lease is not None
        leases.append(lease)
    recorder = hold_async(store)
    tasks = await _behind_a_held_append(
        recorder, [gateway.issue_grant(lease, scopes=SCOPES, ttl=20) for lease in leases])
    await _until_async(lambda: appends_queued(store) == len(leases) - 1)
    return leases, recorder, tasks


async def _behind_a_held_append(recorder: Recorder, calls: Sequence[Coroutine[Any, Any, T]]
                                ) -> list[asyncio.Task[T]]:
    """The first call started alone until its append is held at the sending step, then the
    others, which queue behind it. (Calls started together with nothing held go out as one
    batch from the first: a lone append waits for them while the reads' pump runs.)"""
    first = asyncio.create_task(calls[0])
    await _until_async(lambda: recorder.held)
    return [first, *(asyncio.create_task(call) for call in calls[1:])]



def _until(condition: Callable[[], bool], limit: float = HOLD) -> None:
    ends = time.monotonic() + limit
    while not condition():
        if time.monotonic() > ends:
            raise AssertionError("condition not reached")
        time.sleep(0.002)


async def _until_async(condition: Callable[[], bool], limit: float = HOLD) -> None:
    ends = time.monotonic() + limit
    while not condition():
        if time.monotonic() > ends:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)


def _answer(result: GrantResult) -> tuple[Any, ...]:
    grant = result.grant
    return (result.outcome, result.reason,
            None if grant is None else (grant.epoch, grant.lease_id, grant.scopes))


def _issues(records: Any, identity: LeaseIdentity) -> list[tuple[Any, ...]]:
    return [(r.entry.outcome, r.entry.reason, r.entry.epoch, r.entry.correlation_id)
            for r in records if r.entry.event is LifecycleEvent.GRANT_ISSUE
            and r.entry.identity == identity]


# The bindings of each test, and the grant each asks for: the issued ones and one refusal of
# each kind a row decides (a lease taken over since, scopes the lease does not allow).
NAMES = ("a0", "a1", "stale", "a2", "scopes", "a3")
EXPECTED = {"a0": None, "a1": None, "a2": None, "a3": None, "stale": Reason.STALE_EPOCH,
            "scopes": Reason.SCOPE_NOT_AUTHORIZED}


def _asked(name: str) -> list[str]:
    return ["tool:write"] if name == "scopes" else SCOPES


@pytest.fixture
def async_store(pg_dsn: str) -> Iterator[Callable[..., ShiftedAsyncPostgresLeaseStore]]:
    def make(**options: Any) -> ShiftedAsyncPostgresLeaseStore:
        return ShiftedAsyncPostgresLeaseStore(pg_dsn, **options)

    yield make


async def _async_leases(gateway: AsyncConnectorLeaseCoordinator,
                        tenant: str) -> dict[str, LeaseHandle]:
    leases = {}
    for name in NAMES:
        lease = (await gateway.acquire(LeaseIdentity(tenant, name, "b"), "c1",
                                       scopes=SCOPES, ttl=60)).lease
        assert lease is not None
        leases[name] = lease
    stale = leases["stale"]
    assert (await gateway.takeover(stale.identity, "c2", scopes=SCOPES, ttl=60,
                                   expected_epoch=1)).ok
    return leases


def test_overlapping_asyncio_grants_share_one_audit_statement_each_judged_alone(
        async_store: Callable[..., ShiftedAsyncPostgresLeaseStore], pg_tenant: str) -> None:
    async def main() -> None:
        async with async_store() as store:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            leases = await _async_leases(gateway, pg_tenant)
            lone = {n: _answer(await gateway.issue_grant(leases[n], scopes=_asked(n), ttl=20))
                    for n in NAMES}
            assert {n: answer[1] for n, answer in lone.items()} == EXPECTED
            before = {n: len(_issues(await store.audit(leases[n].identity), leases[n].identity))
                      for n in NAMES}
            recorder = hold_async(store)
            tasks = await _behind_a_held_append(recorder, [
                gateway.issue_grant(leases[n], scopes=_asked(n), ttl=20,
                                    correlation_id=f"req-{n}") for n in NAMES])
            await _until_async(lambda: appends_queued(store) == len(NAMES) - 1)
            recorder.release.set()
            results = dict(zip(NAMES, await asyncio.gather(*tasks), strict=True))
            assert {n: _answer(r) for n, r in results.items()} == lone
            # Six grants: two loads and two audit statements (one commit for five of them).
            assert recorder.of("record.sql", "record_many.sql") == [
                ("record.sql", 1), ("record_many.sql", len(NAMES) - 1)]
            assert recorder.of("load.sql", "load_many.sql") == [
                ("load.sql", 1), ("load_many.sql", len(NAMES) - 1)]
            for n in NAMES:  # each its own audit row, saying what it was told
                identity = leases[n].identity
                rows = _issues(await store.audit(identity), identity)
                assert len(rows) == before[n] + 1
                outcome = Outcome.DENIED if EXPECTED[n] else Outcome.GRANT_ISSUED
                assert rows[-1] == (outcome, EXPECTED[n], leases[n].epoch, f"req-{n}")

    asyncio.run(main())


def test_overlapping_threads_grants_share_one_audit_statement(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    leases = {}
    for name in NAMES:
        lease = gateway.acquire(LeaseIdentity(pg_tenant, name, "b"), "c1", scopes=SCOPES,
                                ttl=60).lease
        assert lease is not None
        leases[name] = lease
    assert gateway.takeover(leases["stale"].identity, "c2", scopes=SCOPES, ttl=60,
                            expected_epoch=1).ok
    lone = {n: _answer(gateway.issue_grant(leases[n], scopes=_asked(n), ttl=20))
            for n in NAMES}
    recorder = hold_sync(store)
    out: dict[str, Any] = {}

    def issue(name: str) -> None:
        out[name] = gateway.issue_grant(leases[name], scopes=_asked(name), ttl=20)

    threads = [threading.Thread(target=issue, args=(n,), daemon=True) for n in NAMES]
    for thread in threads:
        thread.start()
    _until(lambda: appends_queued(store) == len(NAMES) - 1)
    recorder.release.set()
    for thread in threads:
        thread.join(HOLD)
    assert {n: _answer(r) for n, r in out.items()} == lone
    assert {n: r.reason for n, r in out.items()} == EXPECTED
    assert recorder.of("record.sql", "record_many.sql") == [
        ("record.sql", 1), ("record_many.sql", len(NAMES) - 1)]


def test_a_takeover_racing_a_batch_leaves_no_grant_valid_under_the_old_epoch(
        async_store: Callable[..., ShiftedAsyncPostgresLeaseStore], pg_tenant: str) -> None:
    async def main() -> None:
        async with async_store() as store, async_store() as other:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            rival = AsyncConnectorLeaseCoordinator(other, AllowAllPolicy())
            leases, recorder, tasks = await _grants_queued(gateway, store, pg_tenant)
            # Every grant has read its lease; the rival takes one over before they are issued.
            taken = leases[2]
            assert (await rival.takeover(taken.identity, "c2", scopes=SCOPES, ttl=60,
                                         expected_epoch=1)).ok
            recorder.release.set()
            results = await asyncio.gather(*tasks)
            assert ("record_many.sql", len(leases) - 1) in recorder.sent
            for lease, result in zip(leases, results, strict=True):
                assert result.grant is not None
                checked = await gateway.validate(result.grant, identity=lease.identity,
                                                 scopes=SCOPES)
                if lease is taken:  # minted under epoch 1, which is no longer the lease's
                    assert checked.reason is Reason.STALE_EPOCH
                else:
                    assert checked.ok

    asyncio.run(main())


def test_a_cancelled_grant_in_a_batch_is_cancelled_and_the_others_are_issued(
        async_store: Callable[..., ShiftedAsyncPostgresLeaseStore], pg_tenant: str) -> None:
    async def main() -> None:
        async with async_store() as store:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            leases, recorder, tasks = await _grants_queued(gateway, store, pg_tenant)
            victim = tasks[3]
            victim.cancel()
            await asyncio.wait([victim])
            assert victim.cancelled()  # raised on, never swallowed
            recorder.release.set()
            others = [t for t in tasks if t is not victim]
            assert all(r.ok for r in await asyncio.gather(*others))
            assert ("record_many.sql", len(leases) - 2) in recorder.sent
            for i, lease in enumerate(leases):  # the victim's append was never sent
                rows = _issues(await store.audit(lease.identity), lease.identity)
                assert len(rows) == (0 if i == 3 else 1)

    asyncio.run(main())


def test_a_grant_whose_bound_passes_while_queued_fails_closed_and_writes_nothing(
        async_store: Callable[..., ShiftedAsyncPostgresLeaseStore], pg_tenant: str) -> None:
    bound = 0.6

    async def main() -> None:
        async with async_store(settings=ConnectionSettings(call_timeout=bound)) as store:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            leases = []
            for i in range(2):
                lease = (await gateway.acquire(LeaseIdentity(pg_tenant, f"a{i}", "b"), "c1",
                                               scopes=SCOPES, ttl=60)).lease
                assert lease is not None
                leases.append(lease)
            recorder = hold_async(store)
            lone = asyncio.create_task(gateway.issue_grant(leases[0], scopes=SCOPES, ttl=20))
            await _until_async(lambda: recorder.held)
            began = time.monotonic()
            with pytest.raises(StoreUnavailable, match="audit record"):
                await gateway.issue_grant(leases[1], scopes=SCOPES, ttl=20)
            elapsed = time.monotonic() - began
            assert bound * 0.5 <= elapsed <= bound + 0.5
            assert appends_queued(store) == 0
            recorder.release.set()
            await asyncio.gather(lone, return_exceptions=True)
            assert _issues(await store.audit(leases[1].identity), leases[1].identity) == []

    asyncio.run(main())


def _entry(identity: LeaseIdentity, n: int, event_id: Any = None) -> AuditEntry:
    return AuditEntry(event_id or uuid7(), LifecycleEvent.GRANT_ISSUE, Outcome.GRANT_ISSUED,
                      None, identity, "c1", n + 1, f"batch-{n}")


def test_a_batch_resent_logs_once_and_a_taken_event_id_fails_only_its_own_entry(
        pg_store: ShiftedPostgresLeaseStore, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "a", "b")
    batch = [_entry(identity, n) for n in range(3)]
    pg_store.record_many(batch)
    pg_store.record_many(batch)  # a resend of the same records: nothing logged twice
    assert len(_issues(pg_store.audit(identity), identity)) == 3
    # Another record under an event id the log already holds: that entry's error alone.
    clash = _entry(identity, 99, event_id=batch[1].event_id)
    fresh = [_entry(identity, 10), clash, _entry(identity, 11)]
    with pytest.raises(InternalInconsistency, match=str(clash.event_id)):
        pg_store.record_many(fresh)
    logged = {r.entry.event_id for r in pg_store.audit(identity)}
    assert fresh[0].event_id in logged and fresh[2].event_id in logged
    assert len(_issues(pg_store.audit(identity), identity)) == 5


def test_the_supervisors_grants_at_once_share_one_audit_statement(
        async_store: Callable[..., ShiftedAsyncPostgresLeaseStore], pg_tenant: str) -> None:
    async def main() -> None:
        async with async_store() as store:
            coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            identities = [LeaseIdentity(pg_tenant, f"s{i}", "b") for i in range(6)]
            async with AsyncSupervisor(coordinator) as supervisor:
                changes = supervisor.changes()
                for identity in identities:
                    supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=30.0)
                started = 0
                async for change in changes:
                    started += isinstance(change, BindingStarted)
                    if started == len(identities):
                        break
                recorder = hold_async(store)
                tasks = await _behind_a_held_append(recorder, [
                    supervisor.issue_grant(i, scopes=SCOPES, ttl=10) for i in identities])
                await _until_async(lambda: appends_queued(store) == len(identities) - 1)
                recorder.release.set()
                assert all(r.ok for r in await asyncio.gather(*tasks))
                assert recorder.of("record.sql", "record_many.sql") == [
                    ("record.sql", 1), ("record_many.sql", len(identities) - 1)]

    asyncio.run(main())


def test_a_coalesced_load_says_how_long_it_waited_before_its_statement_went_out(
        pg_store: ShiftedPostgresLeaseStore, pg_tenant: str) -> None:
    identities = [LeaseIdentity(pg_tenant, f"q{i}", "b") for i in range(3)]
    release = threading.Event()
    real = pg_store._attempt

    def attempt(call: Any, covers: Any, deadline: float) -> Any:
        if call.statement.name == "load.sql" and not release.is_set():
            release.wait(HOLD)  # the lone load, held while the others queue
        return real(call, covers, deadline)

    pg_store._attempt = attempt  # type: ignore[method-assign]
    out: dict[int, Any] = {}

    def load(k: int) -> None:
        out[k] = pg_store.load(identities[k])

    first = threading.Thread(target=load, args=(0,), daemon=True)
    first.start()
    _until(lambda: pg_store._reads._reads.busy)
    rest = [threading.Thread(target=load, args=(k,), daemon=True) for k in (1, 2)]
    for thread in rest:
        thread.start()
    _until(lambda: len(pg_store._reads._reads.waiting) == 2)
    time.sleep(0.2)
    release.set()
    for thread in [first, *rest]:
        thread.join(HOLD)
    assert out[0].queued == 0.0  # sent at once
    assert all(0.2 <= out[k].queued < HOLD for k in (1, 2))


def test_an_entry_the_database_refuses_fails_alone_and_the_rest_of_its_batch_is_written(
        pg_store: ShiftedPostgresLeaseStore, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "a", "b")
    bad = attrs.evolve(_entry(identity, 5), epoch=0)  # the log's epoch check refuses it
    batch = [_entry(identity, 1), bad, _entry(identity, 2)]
    with pytest.raises(InternalInconsistency, match="refused"):
        pg_store.record_many(batch)
    logged = {r.entry.event_id for r in pg_store.audit(identity)}
    assert logged == {batch[0].event_id, batch[2].event_id}


def test_grants_in_step_go_out_together_each_round(
        async_store: Callable[..., ShiftedAsyncPostgresLeaseStore], pg_tenant: str) -> None:
    # Callers issuing grants in a loop: the answers of one batch wake them together, and each
    # moves on to its next call; those calls must go out together again (one load and one
    # append per round), not one alone and the rest behind it, round after round.
    callers, rounds = 8, 4

    async def main() -> None:
        async with async_store() as store:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            leases = []
            for i in range(callers):
                lease = (await gateway.acquire(LeaseIdentity(pg_tenant, f"r{i}", "b"), "c1",
                                               scopes=SCOPES, ttl=60)).lease
                assert lease is not None
                leases.append(lease)
            recorder = hold_async(store)
            recorder.release.set()  # nothing held: only counted
            recorder.held = True

            async def caller(lease: LeaseHandle) -> None:
                for _ in range(rounds):
                    assert (await gateway.issue_grant(lease, scopes=SCOPES, ttl=20)).ok

            await asyncio.gather(*(caller(lease) for lease in leases))
            assert recorder.of("record.sql", "record_many.sql") == [
                ("record_many.sql", callers)] * rounds
            # The very first load goes alone (nothing was busy yet); the rest in step.
            assert recorder.of("load.sql", "load_many.sql") == [
                ("load.sql", 1), ("load_many.sql", callers - 1)] + [
                ("load_many.sql", callers)] * (rounds - 1)
            stats = store.stats()
            assert stats.records_batched == callers * rounds
            assert stats.record_batches == rounds

    asyncio.run(main())
