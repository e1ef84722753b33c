"""The supervisor's campaign and close in batches, on the in-memory store: the reads,
acquires and releases of thousands of bindings go out one call per 1,000, and ``close()``
reports each binding's loss once its release is written."""

from __future__ import annotations

import asyncio
from typing import Any

from mos_lease import AllowAllPolicy, AsyncConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.results import HolderView
from mos_lease.supervisor import AsyncSupervisor, BindingLost, BindingStarted, Change
from mos_lease.vocabulary import LeaseState
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.core.test_supervisor import SCOPES, TTL, Rig, ident

N = 2500  # three batches of at most 1,000


def _released(store: InMemoryLeaseStore, identity: LeaseIdentity) -> bool:
    # Read past the counting wrapper: this look is the test's, not the supervisor's.
    snapshot = InMemoryLeaseStore.load(store, identity)
    assert snapshot.row is not None
    return HolderView.of(snapshot.row, snapshot.now).state is LeaseState.RELEASED


def test_new_bindings_are_read_then_acquired_one_call_per_thousand() -> None:
    rig = Rig()
    for i in range(N):
        rig.supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
    rig.settle()
    assert len(rig.of(BindingStarted)) == N
    assert rig.store.calls == {"load_many": 3, "acquire_many": 3}
    assert rig.store.rows_read == N


def test_the_writes_a_batch_of_reads_decides_are_made_right_after_it() -> None:
    """One turn reads a batch, makes the acquires it decided, then reads the next batch: a
    binding read early is held before the others are read, not a turn later (a gateway
    taking over a few thousand released bindings holds the first thousand a few reads
    sooner)."""
    rig = Rig()
    for i in range(N):
        rig.supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
    rig.supervisor.turn()
    assert rig.store.order == ["load_many", "acquire_many"] * 3
    assert len(rig.of(BindingStarted)) == N


def test_close_releases_one_call_per_thousand_and_reports_each_loss_after_its_release(
        ) -> None:
    rig = Rig()
    for i in range(N):
        rig.supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
    rig.settle()
    seen: list[bool] = []

    def on_change(change: Change) -> None:
        if isinstance(change, BindingLost):
            seen.append(_released(rig.store, change.identity))
            assert rig.supervisor.lease(change.identity) is None

    rig.supervisor._core.on_change = on_change
    rig.store.reset()
    rig.supervisor.close()
    assert rig.store.calls == {"release_many": 3}
    assert len(seen) == N and all(seen)


def test_close_releases_every_lease_before_it_drops_a_binding_and_remove_waits_for_it(
        ) -> None:
    """The releases go out first (the members taking the bindings over wait for them, not
    for the CPU of dropping thousands of bindings); during them no lease is handed out and
    ``remove()`` does nothing (``close()`` releases the lease and reports it, once)."""
    rig = Rig()
    for i in range(N):
        rig.supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
    rig.settle()
    during: list[tuple[int, int, object, object]] = []
    release_many = rig.store.release_many

    def watched(items: Any) -> Any:
        supervisor = rig.supervisor
        during.append((len(supervisor.bindings), len(rig.of(BindingLost)),
                       supervisor.lease(ident(N - 1)), supervisor.remove(ident(0))))
        return release_many(items)

    rig.store.release_many = watched  # type: ignore[method-assign]
    rig.store.reset()
    rig.supervisor.close()
    assert during == [(N, 0, None, None)] * 3
    assert rig.store.calls == {"release_many": 3}
    lost = rig.of(BindingLost)
    assert len(lost) == N and len({change.identity for change in lost}) == N
    assert all(_released(rig.store, ident(i)) for i in range(N))
    assert rig.supervisor.bindings == []


def test_the_asyncio_supervisor_closes_in_batches_too() -> None:
    async def main() -> list[bool]:
        store = AsyncInMemoryLeaseStore()
        coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        seen: list[bool] = []

        def on_change(change: Change) -> None:
            if isinstance(change, BindingLost):
                seen.append(_released(store.sync, change.identity))

        supervisor = AsyncSupervisor(coordinator, on_change=on_change, background=False,
                                     sleep=lambda _s: asyncio.sleep(0))
        for i in range(1200):
            supervisor.add(ident(i), "gw-a", scopes=SCOPES, ttl=TTL)
        for _ in range(2):  # the first reads, then the acquires
            await supervisor.turn()
        assert supervisor.lease(ident(1199)) is not None
        await supervisor.close()
        return seen

    seen = asyncio.run(main())
    assert len(seen) == 1200 and all(seen)


def test_writes_are_batched_per_connector_scopes_and_ttl_and_reads_all_together() -> None:
    rig = Rig()
    for i in range(30):
        rig.supervisor.add(ident(i), "gw-a" if i < 20 else "gw-b", scopes=SCOPES,
                           ttl=TTL if i < 10 else 2 * TTL)
    rig.settle()
    assert len(rig.of(BindingStarted)) == 30
    # One read of all 30; the acquires as (gw-a, TTL), (gw-a, 2 TTL) and (gw-b, 2 TTL).
    assert rig.store.calls == {"load_many": 1, "acquire_many": 3}
    assert {c.lease.connector_id for c in rig.of(BindingStarted)} == {"gw-a", "gw-b"}
