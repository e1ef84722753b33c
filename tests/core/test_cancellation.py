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
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    LeaseIdentity,
    hold,
)
from mos_lease.holder import HoldTiming
from mos_lease.keeper import AsyncLeaseKeeper
from mos_lease.vocabulary import LeaseState
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


def test_a_hold_cancelled_after_its_acquire_was_written_releases_the_lease() -> None:
    """The cancellation reaches hold() after the store wrote the acquire and before its reply
    came back: the engine lets the call end and releases the lease it won before the
    cancelled task ends, instead of leaving it held until its ttl runs out."""
    written, reply = asyncio.Event(), asyncio.Event()

    class ReplyInFlight(AsyncConnectorLeaseCoordinator):
        async def acquire_many(self, *args: Any, **kwargs: Any) -> Any:
            results = await super().acquire_many(*args, **kwargs)
            written.set()
            await reply.wait()  # the reply is on its way back
            return results

    async def scenario() -> None:
        store = AsyncInMemoryLeaseStore()
        coordinator = ReplyInFlight(store, AllowAllPolicy())

        async def enter() -> None:
            async with hold(coordinator, IDENTITY, "me", scopes=["x"], ttl=10):
                pytest.fail("entered a block whose task was cancelled")

        task = asyncio.ensure_future(enter())
        await written.wait()
        task.cancel()
        asyncio.get_running_loop().call_later(0.05, reply.set)
        with pytest.raises(asyncio.CancelledError):
            await task
        # Ended cancelled, and nothing it started is left: the lease it won is released.
        view = await coordinator.current_holder(IDENTITY)
        assert view is not None and (view.connector_id, view.state) == ("me",
                                                                        LeaseState.RELEASED)

    asyncio.run(scenario())
