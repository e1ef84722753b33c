"""The library never swallows a cancellation (Python 3.11 is the minimum version).

Each test cancels a task at the one moment an ``asyncio.wait_for`` on 3.11, or a
``suppress(CancelledError)`` around an awaited task, would drop the cancellation: as the
event a holder pauses on is set, and while a keeper's ``stop`` waits for its renewal task.
The cancelled task must end cancelled, not go on. (The connection's lock is tested against
PostgreSQL in ``test_pg_cancellation.py``; every asyncio entry point at random moments in
fault scenario 22.)
"""

from __future__ import annotations

import asyncio

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    LeaseIdentity,
    hold,
)
from mos_lease.holder import HoldTiming
from mos_lease.keeper import AsyncLeaseKeeper
from mos_lease_memory import AsyncInMemoryLeaseStore

IDENTITY = LeaseIdentity("tenant", "agent", "binding")


def test_a_waiting_holder_cancelled_as_it_is_woken_ends_cancelled() -> None:
    async def scenario() -> None:
        coordinator = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(),
                                                     policy=AllowAllPolicy())
        assert (await coordinator.acquire(IDENTITY, "rival", scopes=["x"], ttl=60)).ok
        holder = hold(coordinator, IDENTITY, "me", scopes=["x"], ttl=10, wait=30,
                      timing=HoldTiming(min_backoff=5.0, max_backoff=5.0))

        async def body() -> None:
            async with holder:
                pytest.fail("the holder got a lease that another connector holds")

        task = asyncio.create_task(body())
        await asyncio.sleep(0.2)  # tried, refused, now pausing
        assert not task.done()
        holder._wake()  # what a notice does: the pause ends at once...
        task.cancel()  # ...and the cancellation arrives in the same instant
        done, _ = await asyncio.wait((task,), timeout=2.0)
        assert done, "the cancellation was swallowed: the holder went on waiting"
        assert task.cancelled(), task.exception()

    asyncio.run(scenario())


def test_a_keeper_stop_cancelled_while_it_waits_for_its_task_ends_cancelled() -> None:
    async def scenario() -> None:
        coordinator = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(),
                                                     policy=AllowAllPolicy())
        keeper = AsyncLeaseKeeper(coordinator, ttl=10)
        assert (await keeper.acquire(IDENTITY, "me", scopes=["x"])).ok
        stopping = asyncio.create_task(keeper.stop())
        await asyncio.sleep(0)  # stop() has cancelled the renewal task and waits for it
        stopping.cancel()
        done, _ = await asyncio.wait((stopping,), timeout=2.0)
        assert done
        assert stopping.cancelled(), "stop() swallowed its caller's cancellation"

    asyncio.run(scenario())
