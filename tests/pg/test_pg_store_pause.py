"""The PostgreSQL store pauses as the rest of the library does: reconciling a write in doubt
yields :class:`mos_lease.sleep.Sleep` between its looks at the server (one pause, one name),
and each store performs that step by waiting its seconds. The flows and steps are driven by
hand here: no statement is sent, so no server is needed."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from mos_lease.sleep import Sleep
from mos_lease_pg import AsyncPostgresLeaseStore, PostgresLeaseStore, reconcile
from mos_lease_pg.reconcile import Lost
from mos_lease_pg.statements import Call

# Never connected to: the stores open their connection on first use, and nothing here uses it.
NOWHERE = "postgresql://nobody@127.0.0.1:1/nothing"


def what(step: object) -> str:
    """What statement ``step`` is (failing if it is not one)."""
    assert isinstance(step, Call)
    return step.what


def test_waiting_for_a_lost_backend_to_end_pauses_with_sleep() -> None:
    store = PostgresLeaseStore(NOWHERE)
    flow = store._ending(Lost(("127.0.0.1", "1", "nothing"), 4242), store._clock() + 60)
    assert what(next(flow)) == "end of the lost backend"
    assert what(flow.send(1)) == "lost backend lookup"
    pause = flow.send(True)  # still alive: look again after a pause
    assert pause == Sleep(reconcile.POLL)
    assert what(flow.send(None)) == "lost backend lookup"


def test_waiting_out_the_roles_transactions_pauses_with_sleep() -> None:
    store = PostgresLeaseStore(NOWHERE)
    flow = store._ending(None, store._clock() + 60)
    assert what(next(flow)) == "in-flight transaction lookup"
    pause = flow.send((datetime(2030, 1, 1, tzinfo=UTC), 2))  # two still running
    assert pause == Sleep(reconcile.POLL)
    assert what(flow.send(None)) == "in-flight transaction lookup"


def test_the_sync_store_performs_a_pause_by_sleeping(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("mos_lease_pg.store.time.sleep", slept.append)
    store = PostgresLeaseStore(NOWHERE)
    assert store._perform(Sleep(0.25), store._clock() + 60) is None
    assert slept == [0.25]


def test_the_asyncio_store_performs_a_pause_by_sleeping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def perform() -> object:
        store = AsyncPostgresLeaseStore(NOWHERE)
        monkeypatch.setattr("mos_lease_pg.store.asyncio.sleep", sleep)
        try:
            return await store._perform(Sleep(0.25), store._clock() + 60)
        finally:
            monkeypatch.undo()

    assert asyncio.run(perform()) is None
    assert slept == [0.25]
