"""The threads and tasks ``docs/keeping.md`` says each supervisor runs ("Threads, tasks and
round trips") are the ones it really starts: counted on the in-memory store (which starts
nothing of its own) with the benchmark's census of ``bench/supervisor.py`` (every thread's
``run`` and every task of the loop counted in and out), over more than 1,000 bindings so
that two renewal batches are in flight, and with a ``LeaseNotices`` given a notice for a
binding, its connection refused (the notice is handed to it as the listener would)."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
)
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.supervisor import AsyncSupervisor, BindingLost, BindingStarted, Supervisor
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from mos_lease_pg.notices import LeaseNotices

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCOPES = ["tool:shell"]
TTL = 2.0  # renewals every second or so
BINDINGS = 1_100  # two renewal batches of at most 1,000
AGENTS = [LeaseIdentity("acme", f"agent-{n}", "main") for n in range(BINDINGS)]
NOWHERE = "host=127.0.0.1 port=1 connect_timeout=2"  # a listener whose connection is refused


def _bench(name: str) -> ModuleType:
    # The benchmark's modules import each other by plain name, from bench/.
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _count(cell: str) -> int:
    if cell == "none":
        return 0
    found = re.match(r"\d+", cell)
    assert found is not None, f"docs/keeping.md: no count in {cell!r}"
    return int(found.group())


def documented(row: str) -> tuple[int, int]:
    """(threads, tasks) that the page's table gives ``row``."""
    page = (ROOT / "docs" / "keeping.md").read_text()
    section = page[page.index("## Threads, tasks and round trips"):]
    (line,) = [line for line in section.splitlines() if line.startswith(f"| {row} |")]
    cells = [cell.strip() for cell in line.strip("|").split(" | ")]
    return _count(cells[1]), _count(cells[2])


SUPERVISOR = "`Supervisor`, N bindings"
ASYNC_SUPERVISOR = "`AsyncSupervisor`, N bindings"
NOTICES = "`notices=`, either supervisor"


@pytest.fixture
def census() -> Iterator[Any]:
    threads = _bench("supervisor").Census()
    threads.install()
    try:
        yield threads
    finally:
        threads.uninstall()


def notice(identity: LeaseIdentity, epoch: int) -> str:
    return json.dumps({"t": identity.tenant_id, "a": identity.logical_agent_id,
                       "b": identity.binding_id, "e": epoch, "k": "takeover"})


def wait_for(changes: Iterator[Any], kind: type, count: int) -> None:
    seen = 0
    for change in changes:
        seen += isinstance(change, kind)
        if seen == count:
            return


def test_the_thread_supervisor_runs_the_threads_the_page_says(census: Any) -> None:
    store = InMemoryLeaseStore()
    mine = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    rival = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    with Supervisor(mine) as supervisor:
        changes = supervisor.changes()
        for agent in AGENTS:
            supervisor.add(agent, "gateway-a", scopes=SCOPES, ttl=TTL)
        wait_for(changes, BindingStarted, BINDINGS)
        time.sleep(TTL)  # renewal ticks of two batches each
        assert (census.peak, 0) == documented(SUPERVISOR), census.names
    census.peak = 0
    with LeaseNotices(NOWHERE, confirmer=NoticeConfirmer()) as notices, \
            Supervisor(mine, notices=notices) as supervisor:
        changes = supervisor.changes()
        supervisor.add(AGENTS[0], "gateway-a", scopes=SCOPES, ttl=TTL)
        wait_for(changes, BindingStarted, 1)
        held = supervisor.lease(AGENTS[0])
        assert held is not None
        rival.takeover(AGENTS[0], "gateway-b", scopes=SCOPES, ttl=TTL,
                       expected_epoch=held.epoch)
        notices.dispatch(notice(AGENTS[0], held.epoch + 1))
        wait_for(changes, BindingLost, 1)
        threads, tasks = documented(NOTICES)
        assert (census.peak, 0) == (documented(SUPERVISOR)[0] + threads, tasks), census.names
        assert "mos-lease-notice-confirmer" in census.names, census.names


def test_the_asyncio_supervisor_runs_the_tasks_and_threads_the_page_says(census: Any) -> None:
    tasks = _bench("supervisor").TaskCensus()

    async def main() -> None:
        tasks.install()
        store = AsyncInMemoryLeaseStore()
        mine = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        rival = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        async with AsyncSupervisor(mine) as supervisor:
            changes = supervisor.changes()
            for agent in AGENTS:
                supervisor.add(agent, "gateway-a", scopes=SCOPES, ttl=TTL)
            started = 0
            async for change in changes:
                started += isinstance(change, BindingStarted)
                if started == BINDINGS:
                    break
            await asyncio.sleep(TTL)
            assert (census.peak, tasks.peak) == documented(ASYNC_SUPERVISOR)
        census.peak = tasks.peak = 0
        with LeaseNotices(NOWHERE, confirmer=NoticeConfirmer()) as notices:
            async with AsyncSupervisor(mine, notices=notices) as supervisor:
                changes = supervisor.changes()
                supervisor.add(AGENTS[0], "gateway-a", scopes=SCOPES, ttl=TTL)
                async for change in changes:
                    if isinstance(change, BindingStarted):
                        break
                held = supervisor.lease(AGENTS[0])
                assert held is not None
                await rival.takeover(AGENTS[0], "gateway-b", scopes=SCOPES, ttl=TTL,
                                     expected_epoch=held.epoch)
                notices.dispatch(notice(AGENTS[0], held.epoch + 1))
                async for change in changes:
                    if isinstance(change, BindingLost):
                        break
                threads, _ = documented(NOTICES)
                assert census.peak == documented(ASYNC_SUPERVISOR)[0] + threads, census.names
                assert "mos-lease-notice-confirmer" in census.names, census.names

    asyncio.run(main())
