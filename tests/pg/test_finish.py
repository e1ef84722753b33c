"""``finish``: a coroutine awaited to its end even if the awaiting task is cancelled; the
cancellation is delivered afterwards, never dropped, and nothing else is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from mos_lease_pg.finish import finish


def test_a_coroutine_that_does_not_wait_gives_its_value() -> None:
    async def at_once() -> int:
        return 3

    async def scenario() -> int:
        return await finish(at_once())

    assert asyncio.run(scenario()) == 3


@pytest.mark.parametrize("turns", [0, 1, 3])
def test_cancelled_while_the_coroutine_waits_it_still_finishes(turns: int) -> None:
    async def scenario() -> tuple[bool, list[str], bool]:
        lock = asyncio.Lock()
        steps: list[str] = []

        async def give_back() -> None:
            async with lock:  # waits: the lock is held below
                await asyncio.sleep(0)
                steps.append("returned")

        async def caller() -> None:
            await finish(give_back())
            steps.append("went on")  # never: the cancellation comes once it finished

        await lock.acquire()
        task = asyncio.create_task(caller())
        for _ in range(turns + 1):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        lock.release()
        await asyncio.wait((task,), timeout=2)
        return task.cancelled(), steps, lock.locked()

    cancelled, steps, locked = asyncio.run(scenario())
    assert cancelled, "the cancellation was dropped"
    assert steps == ["returned"]
    assert not locked


def test_cancelled_at_a_bare_yield_it_still_finishes() -> None:
    async def scenario() -> tuple[bool, list[int]]:
        done: list[int] = []

        async def turns() -> None:
            for i in range(5):
                await asyncio.sleep(0)
                done.append(i)

        task = asyncio.create_task(finish(turns()))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait((task,), timeout=2)
        return task.cancelled(), done

    cancelled, done = asyncio.run(scenario())
    assert cancelled
    assert done == [0, 1, 2, 3, 4]


def test_a_failure_after_a_cancellation_still_ends_cancelled() -> None:
    async def scenario() -> BaseException | None:
        gate = asyncio.Event()

        async def fails() -> None:
            await gate.wait()
            raise ValueError("after the wait")

        task = asyncio.create_task(finish(fails()))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait((task,), timeout=2)
        assert task.cancelled()
        try:
            task.result()
        except asyncio.CancelledError as cancelled:
            return cancelled.__cause__
        return None

    assert isinstance(asyncio.run(scenario()), ValueError)
