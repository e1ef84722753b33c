"""A flow primed on one thread and finished on another (flowdrive.primed), and the
coordinator's prime_heartbeat_many built on it: the checks and the building happen at once,
the store call only when the rest is called, and the result is heartbeat_many's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    Outcome,
)
from mos_lease.flowdrive import primed
from mos_lease_memory import AsyncInMemoryLeaseStore
from tests.helpers import IDENT, SCOPES, make_env


def _flow(log: list[str]) -> Generator[str, Any, str]:
    log.append("checked")
    first = yield "first call"
    log.append(f"got {first}")
    try:
        yield "second call"
    except KeyError as error:
        log.append(f"thrown {error}")
    return "value"


def test_a_primed_flow_takes_its_first_step_at_once_then_goes_on_as_the_flow_would() -> None:
    log: list[str] = []
    flow = primed(_flow(log))
    assert log == ["checked"]  # done while priming, before anything is sent
    assert flow.send(None) == "first call"
    assert flow.send(1) == "second call"
    with pytest.raises(StopIteration) as done:
        flow.throw(KeyError("k"))
    assert done.value.value == "value"
    assert log == ["checked", "got 1", "thrown 'k'"]


def test_priming_raises_the_first_steps_error_and_a_flow_done_at_once_returns() -> None:
    def bad() -> Generator[str, Any, str]:
        raise InvalidInput("leases", "bad")
        yield "never"

    def done_at_once() -> Generator[str, Any, str]:
        return "at once"
        yield "never"

    with pytest.raises(InvalidInput):
        primed(bad())
    with pytest.raises(StopIteration) as done:
        primed(done_at_once()).send(None)
    assert done.value.value == "at once"


def test_closing_a_primed_flow_closes_the_flow() -> None:
    closed: list[bool] = []

    def flow() -> Generator[str, Any, None]:
        try:
            yield "call"
        finally:
            closed.append(True)

    running = primed(flow())
    assert running.send(None) == "call"
    running.close()
    assert closed == [True]


def test_prime_heartbeat_many_checks_now_and_calls_the_store_only_when_run() -> None:
    env = make_env()
    leases = [env.acquire(LeaseIdentity(IDENT.tenant_id, f"agent-{i}", "b"))
              for i in range(3)]
    before = env.clock.now()
    with pytest.raises(InvalidInput):
        env.coordinator.prime_heartbeat_many(["not a handle"], ttl=60)  # type: ignore[list-item]
    rest = env.coordinator.prime_heartbeat_many(leases, ttl=90)
    assert all(env.store.load(lease.identity).row.heartbeat_at <= before  # type: ignore[union-attr]
               for lease in leases)
    env.clock.advance(1)
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.extend(rest()))
    worker.start()
    worker.join()
    assert [r.outcome for r in results] == [Outcome.RENEWED] * 3
    assert all(isinstance(r.lease, LeaseHandle) and r.lease.identity == lease.identity
               for r, lease in zip(results, leases, strict=True))
    assert all(env.store.load(lease.identity).row.heartbeat_at > before  # type: ignore[union-attr]
               for lease in leases)


def test_the_asyncio_primer_returns_the_awaitable_rest() -> None:
    async def main() -> None:
        coordinator = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(),
                                                     AllowAllPolicy())
        acquired = await coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60)
        assert acquired.lease is not None
        rest = coordinator.prime_heartbeat_many([acquired.lease], ttl=60)
        [result] = await rest()
        assert result.outcome is Outcome.RENEWED and result.current_epoch == 1

    asyncio.run(main())
