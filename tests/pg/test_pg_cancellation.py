"""A call waiting for the store's dedicated asyncio connection, cancelled at the instant the
connection's lock is handed to it, ends cancelled: it does not go on to run its statement.

On Python 3.11 ``asyncio.wait_for(lock.acquire(), t)`` returns the lock it just obtained
and drops a cancellation that arrives at that moment; the checkout waits under
``asyncio.timeout`` instead.
"""

from __future__ import annotations

import asyncio

import pytest

from mos_lease_pg import ConnectionSettings
from mos_lease_pg.connection import AsyncDedicatedConnection

pytestmark = pytest.mark.pg


def test_cancelled_as_the_connection_is_handed_over(pg_dsn: str) -> None:
    async def scenario() -> tuple[int, bool]:
        source = AsyncDedicatedConnection(pg_dsn, ConnectionSettings())
        held, release = asyncio.Event(), asyncio.Event()
        waiter: asyncio.Task[None] | None = None
        ran: list[str] = []

        async def first() -> None:
            async with source.checkout() as wire:
                await wire.execute(b"SELECT 1", {})
                held.set()
                await release.wait()
            # The lock was handed to the waiter just now; it has not run yet.
            assert waiter is not None
            waiter.cancel()

        async def second() -> None:
            async with source.checkout() as wire:
                ran.append("second")
                await wire.execute(b"SELECT 2", {})

        try:
            holding = asyncio.create_task(first())
            await held.wait()
            waiter = asyncio.create_task(second())
            await asyncio.sleep(0.05)  # waiting for the lock
            release.set()
            await holding
            await asyncio.wait((waiter,), timeout=5.0)
            return len(ran), waiter.cancelled()
        finally:
            await source.close()

    ran, cancelled = asyncio.run(scenario())
    assert cancelled and ran == 0, \
        f"the cancellation was swallowed: the call ran ({ran}), cancelled={cancelled}"
