"""Racing threads on one in-memory store: exactly one winner per acquire and per
takeover epoch."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, Outcome, Reason
from tests.helpers import IDENT, SCOPES, CountingIds, Env, make_env, row_of

THREADS = 8


def _race(env: Env, work: Callable[[ConnectorLeaseCoordinator, int], Any]) -> list[Any]:
    barrier = threading.Barrier(THREADS)
    results: list[Any] = [None] * THREADS
    gateways = [ConnectorLeaseCoordinator(env.store, AllowAllPolicy(), id_source=CountingIds())
                for _ in range(THREADS)]

    def run(i: int) -> None:
        barrier.wait()
        results[i] = work(gateways[i], i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(r is not None for r in results)
    return results


def test_racing_acquires_have_exactly_one_winner() -> None:
    for _ in range(20):
        env = make_env()
        results = _race(env, lambda c, i: c.acquire(IDENT, f"conn-{i}", scopes=SCOPES, ttl=10))
        winners = [r for r in results if r.ok]
        assert len(winners) == 1
        assert winners[0].lease.epoch == 1
        assert {r.reason for r in results if not r.ok} == {Reason.LEASE_HELD}
        assert row_of(env.store).connector_id == winners[0].lease.connector_id
        assert [r.entry.outcome for r in env.audit()].count(Outcome.ACQUIRED) == 1


def _takeover_at(epoch: int, c: ConnectorLeaseCoordinator, i: int) -> Any:
    return c.takeover(IDENT, f"conn-{i}", scopes=SCOPES, ttl=10, expected_epoch=epoch)


@pytest.mark.parametrize("active", [True, False], ids=["preempt-active", "expired"])
def test_racing_takeovers_have_exactly_one_winner_per_epoch(active: bool) -> None:
    env = make_env()
    env.acquire(ttl=10)
    for epoch in range(1, 11):
        if not active:
            env.clock.advance(10)  # the current lease has expired for every racer
        results = _race(env, functools.partial(_takeover_at, epoch))
        winners = [r for r in results if r.ok]
        assert len(winners) == 1, [r.reason for r in results]
        assert winners[0].lease.epoch == epoch + 1
        assert {r.reason for r in results if not r.ok} <= {Reason.EPOCH_MISMATCH}
        row = row_of(env.store)
        assert (row.epoch, row.lease_id) == (epoch + 1, winners[0].lease.lease_id)
    taken = [r.entry.epoch for r in env.audit() if r.entry.outcome is Outcome.TAKEN_OVER]
    assert taken == list(range(2, 12))
