"""Scenario 22: cancellation fuzz -> 0 swallowed, 0 wrong outcomes, 0 connections mid-protocol.

Every asyncio entry point is cancelled at a seeded random moment, thousands of times: the
coordinator's operations (``acquire``, ``takeover``, ``heartbeat``, ``heartbeat_many``,
``release``, ``issue_grant``, ``validate`` granted and denied, ``invoke``,
``current_holder``, ``reconcile``), the store's own calls (``load``, ``now``, ``leases``,
``audit``), ``async with hold(...)`` (entering, the block, leaving), a holder waiting for
a held lease (cancelled as a notice wakes it, half of the time), and an
``AsyncLeaseKeeper`` (acquire, grant, stop). The moment is either a number of event-loop
turns or a delay of up to a few milliseconds after the call starts; two more tasks loop on
calls of the same store meanwhile, so every call also waits for its connection (the moment
the connection is handed over is where ``asyncio.wait_for`` on 3.11 drops a cancellation),
and are cancelled too at the end of every ten trials. On a dedicated connection and on a
pool. Judged:

* swallowed: a task whose ``cancel()`` was accepted must end cancelled, within the call
  bound; one that finished first must have the right outcome;
* wrong outcomes: after each trial the store's read of the identity equals the row an
  admin connection reads (no reply left for the next call to mistake for its own), and the
  history checker finds nothing in the audit log and final rows;
* mid-protocol: after every ten trials the dedicated connection is idle or closed, the pool has
  every connection back and each is idle, and no server session of the store is still
  running a statement;
* ``cancel_on_loss``: a block looping on store calls while a rival takes over (the loss is
  confirmed by a read on a notice) ends with ``LeaseLost`` within the call bound of the
  confirmed loss.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    LeaseIdentity,
    LeaseLost,
    LeaseNotAcquired,
    hold,
)
from mos_lease.holder import HoldCallbacks, HoldTiming
from mos_lease.keeper import AsyncLeaseKeeper
from mos_lease_pg import AsyncPostgresLeaseStore, ConnectionSettings, open_async_pool
from tests.faults.history import check_history
from tests.faults.support import Table, audit_rows, final_rows, percentile, run_prefix, scaled

pytestmark = [pytest.mark.faults, pytest.mark.pg]

APP = "faults-cancel"
SETTINGS = ConnectionSettings(statement_timeout=timedelta(seconds=2), pool_timeout=2.0,
                              application_name=APP)
BOUND = SETTINGS.call_bound()  # 3 s
SCOPES = ["tools.read"]
SEED = 22
ROUND = 10  # trials between two looks at the connections
# Each part of a source stops after this many failures: enough to show a hole, and a library that
# swallows cancellations leaves tasks running that would slow every later trial down.
STOP = 25

Run = Callable[[], Awaitable[object]]
Expect = Callable[[object], bool]


@dataclass
class Trial:
    """One entry point, ready to run: the call, what it must give when it finishes before
    the cancellation, and what to do just before cancelling (a notice's wake-up)."""

    run: Run
    expect: Expect
    poke: Callable[[], None] | None = None


@dataclass
class Tally:
    trials: int = 0
    accepted: int = 0  # cancel() accepted: the task had not finished
    cancelled: int = 0
    swallowed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    mid_protocol: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    entries: Counter[str] = field(default_factory=Counter)
    noise_cancelled: int = 0
    loss_trials: int = 0
    loss_raised: int = 0
    loss_latencies: list[float] = field(default_factory=list)
    calls_after_loss: list[int] = field(default_factory=list)

    def failures(self) -> int:
        return len(self.swallowed) + len(self.wrong) + len(self.mid_protocol)


class Bench:
    """One source's store and coordinator, a rival gateway on a store of its own, and the
    admin connection the checks read through."""

    def __init__(self, store: AsyncPostgresLeaseStore, rival: AsyncConnectorLeaseCoordinator,
                 admin: psycopg.Connection[Any], prefix: str, source: str) -> None:
        self.store = store
        self.coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        self.rival = rival
        self.admin = admin
        self.prefix = prefix
        self.source = source
        self.count = 0
        self.stopping = False
        self.noise_identity = LeaseIdentity(prefix, "noise", "b")  # replaced by a held one

    def identity(self) -> LeaseIdentity:
        self.count += 1
        return LeaseIdentity(self.prefix, f"{self.source}-{self.count}", "b")

    async def lease(self, identity: LeaseIdentity) -> Any:
        result = await self.coordinator.acquire(identity, "me", scopes=SCOPES, ttl=30)
        assert result.ok and result.lease is not None, result
        return result.lease

    async def grant(self, identity: LeaseIdentity) -> Any:
        granted = await self.coordinator.issue_grant(await self.lease(identity),
                                                     scopes=SCOPES, ttl=20)
        assert granted.grant is not None, granted
        return granted.grant


def _ok(result: object) -> bool:
    return bool(getattr(result, "ok", False))


async def _trial(bench: Bench, entry: str, identity: LeaseIdentity,
                 rng: random.Random) -> Trial:
    """The entry point ``entry`` on ``identity``, its preconditions set up (not cancelled)."""
    c, store = bench.coordinator, bench.store
    if entry == "acquire":
        return Trial(lambda: c.acquire(identity, "me", scopes=SCOPES, ttl=30), _ok)
    if entry == "takeover":
        assert (await bench.rival.acquire(identity, "rival", scopes=SCOPES, ttl=30)).ok
        return Trial(lambda: c.takeover(identity, "me", scopes=SCOPES, ttl=30,
                                        expected_epoch=1), _ok)
    if entry in ("heartbeat", "heartbeat_many", "release", "issue_grant", "current_holder",
                 "reconcile", "load", "audit"):
        lease = await bench.lease(identity)
        calls: dict[str, tuple[Run, Expect]] = {
            "heartbeat": (lambda: c.heartbeat(lease, ttl=30), _ok),
            "heartbeat_many": (lambda: c.heartbeat_many([lease], ttl=30),
                               lambda r: isinstance(r, list) and all(_ok(x) for x in r)),
            "release": (lambda: c.release(lease), _ok),
            "issue_grant": (lambda: c.issue_grant(lease, scopes=SCOPES, ttl=10), _ok),
            "current_holder": (lambda: c.current_holder(identity),
                               lambda v: getattr(v, "epoch", None) == 1),
            "reconcile": (lambda: c.reconcile(identity, uuid4()), lambda r: r is False),
            "load": (lambda: store.load(identity),
                     lambda s: getattr(getattr(s, "row", None), "lease_id", None)
                     == lease.lease_id),
            "audit": (lambda: store.audit(identity), lambda rows: len(rows) >= 1),  # type: ignore[arg-type]
        }
        return Trial(*calls[entry])
    if entry == "validate":
        grant = await bench.grant(identity)
        return Trial(lambda: c.validate(grant, identity=identity, scopes=SCOPES),
                     lambda r: getattr(r, "context", None) is not None)
    if entry == "validate_denied":
        grant = await bench.grant(identity)
        assert (await bench.rival.takeover(identity, "rival", scopes=SCOPES, ttl=30,
                                           expected_epoch=1)).ok
        return Trial(lambda: c.validate(grant, identity=identity, scopes=SCOPES),
                     lambda r: str(getattr(r, "reason", "")) == "stale_epoch")
    if entry == "invoke":
        grant = await bench.grant(identity)

        async def adapter(_ctx: object) -> int:
            await asyncio.sleep(0)
            return 7

        return Trial(lambda: c.invoke(grant, adapter, identity=identity, scopes=SCOPES),
                     lambda r: getattr(r, "value", None) == 7)
    if entry == "now":
        return Trial(store.now, lambda r: isinstance(r, datetime))
    if entry == "leases":
        return Trial(lambda: store.leases(identity.tenant_id), lambda r: isinstance(r, list))
    if entry == "hold":
        pause = rng.uniform(0, 0.002)

        async def held() -> object:
            async with hold(c, identity, "me", scopes=SCOPES, ttl=10) as holder:
                await asyncio.sleep(pause)
                granted = await holder.issue_grant(scopes=SCOPES, ttl=5)
                return granted.ok
        return Trial(held, lambda r: r is True)
    if entry == "hold_wait":
        assert (await bench.rival.acquire(identity, "rival", scopes=SCOPES, ttl=30)).ok
        waiter = hold(c, identity, "me", scopes=SCOPES, ttl=10, wait=0.2, takeover="never",
                      timing=HoldTiming(min_backoff=0.01, max_backoff=0.02))

        async def waiting() -> object:
            async with waiter:
                return "held"
        return Trial(waiting, lambda r: isinstance(r, LeaseNotAcquired),
                     poke=waiter._wake if rng.random() < 0.5 else None)
    assert entry == "keeper"

    async def kept() -> object:
        async with AsyncLeaseKeeper(c, ttl=10) as keeper:
            assert (await keeper.acquire(identity, "me", scopes=SCOPES)).ok
            await asyncio.sleep(0)
            return (await keeper.issue_grant(scopes=SCOPES, ttl=5)).ok
    return Trial(kept, lambda r: r is True)


ENTRIES = ("acquire", "takeover", "heartbeat", "heartbeat_many", "release", "issue_grant",
           "validate", "validate_denied", "invoke", "current_holder", "reconcile", "load",
           "now", "leases", "audit", "hold", "hold_wait", "keeper")


async def _outcome(run: Run) -> object:
    """The call's result, or the exception it raised as its result (so an expected refusal
    such as ``LeaseNotAcquired`` is judged like a value); a cancellation propagates."""
    try:
        return await run()
    except (LeaseNotAcquired, LeaseLost) as refused:
        return refused


async def _noise(bench: Bench, identity: LeaseIdentity, which: int,
                 over: list[bool] | None = None) -> None:
    # The flags only end a loop whose cancellation was lost (the round or the source is
    # over): it would load every later trial.
    while not bench.stopping and not (over and over[0]):
        if which:
            await bench.store.now()
        else:
            await bench.coordinator.current_holder(identity)


async def _cancel_at(task: asyncio.Task[Any], rng: random.Random, poke: Callable[[], None] | None,
                     fired: list[tuple[bool, float]]) -> None:
    if rng.random() < 0.5:
        for _ in range(rng.randrange(0, 60)):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(rng.uniform(0, 0.004))
    if poke is not None:
        poke()
    fired.append((task.cancel(), time.monotonic()))


async def _end(task: asyncio.Task[Any]) -> float | None:
    """Wait for a cancelled task; when it ended (``None``: not within the bound)."""
    done, _ = await asyncio.wait((task,), timeout=BOUND + 1.0)
    if not done:
        for _ in range(20):  # again, so the run can go on; the first one was lost
            task.cancel()
            if (await asyncio.wait((task,), timeout=0.25))[0]:
                break
        return None
    return time.monotonic()


async def _round(bench: Bench, tally: Tally, rng: random.Random, trials: int) -> None:
    """``trials`` trials while two more tasks loop on calls of the same store; then those
    are cancelled too, and the connections are looked at once nothing uses them."""
    over = [False]
    noise = [asyncio.ensure_future(_noise(bench, bench.noise_identity, i, over))
             for i in (0, 1)]
    await asyncio.sleep(0)
    for _ in range(trials):
        await _one(bench, tally, rng, rng.choice(ENTRIES))
    where = f"{bench.source} round ending #{bench.count}"
    for other in noise:
        if other.cancel():
            if await _end(other) is None or not other.cancelled():
                tally.swallowed.append(f"{where}: a concurrent call swallowed its cancellation")
            else:
                tally.noise_cancelled += 1
    over[0] = True
    await asyncio.wait(noise, timeout=BOUND)
    await _check_connections(bench, tally, where)


async def _one(bench: Bench, tally: Tally, rng: random.Random, entry: str) -> None:
    identity = bench.identity()
    trial = await _trial(bench, entry, identity, rng)
    task = asyncio.ensure_future(_outcome(trial.run))
    fired: list[tuple[bool, float]] = []
    canceller = asyncio.ensure_future(_cancel_at(task, rng, trial.poke, fired))
    ended = await _end(task)
    await canceller
    tally.trials += 1
    tally.entries[entry] += 1
    accepted, at = fired[0]
    where = f"{bench.source} {entry} #{bench.count}"
    if ended is None:
        tally.swallowed.append(f"{where}: still running {BOUND + 1:g} s after cancel()")
    elif accepted:
        tally.accepted += 1
        if task.cancelled():
            tally.cancelled += 1
            tally.latencies.append(ended - at)
        else:
            error = task.exception()
            ending = f"raised {error!r}" if error else f"returned {task.result()!r}"
            tally.swallowed.append(f"{where}: {ending}")
    else:
        error = task.exception()
        if error is not None or not trial.expect(task.result()):
            tally.wrong.append(f"{where}: {error!r}" if error is not None
                               else f"{where}: {task.result()!r}")
    await _check_reply(bench, tally, identity, where)


async def _check_connections(bench: Bench, tally: Tally, where: str) -> None:
    source: Any = bench.store._source
    if bench.source == "dedicated":
        wire = source._wire
        if wire is not None and not wire.closed \
                and wire.conn.info.transaction_status is not TransactionStatus.IDLE:
            tally.mid_protocol.append(f"{where}: connection left "
                                      f"{wire.conn.info.transaction_status.name}")
    else:
        pool = source._pool
        settle = time.monotonic() + 1.0
        while True:
            stats = pool.get_stats()
            if stats["pool_available"] >= stats["pool_size"] or time.monotonic() > settle:
                break
            await asyncio.sleep(0.005)
        if stats["pool_available"] < stats["pool_size"]:
            tally.mid_protocol.append(f"{where}: {stats['pool_size'] - stats['pool_available']}"
                                      " connection(s) never returned to the pool")
        taken = [await pool.getconn(timeout=2) for _ in range(stats["pool_available"])]
        for conn in taken:
            if conn.info.transaction_status is not TransactionStatus.IDLE:
                tally.mid_protocol.append(f"{where}: pooled connection "
                                          f"{conn.info.transaction_status.name}")
            await pool.putconn(conn)
    settle = time.monotonic() + 1.0
    while True:
        row = bench.admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND state = 'active'", (APP,)).fetchone()
        running = int(row[0]) if row else 0
        if running == 0 or time.monotonic() > settle:
            break
        await asyncio.sleep(0.01)
    if running:
        tally.mid_protocol.append(f"{where}: {running} server session(s) still running")


async def _check_reply(bench: Bench, tally: Tally, identity: LeaseIdentity,
                       where: str) -> None:
    snapshot = await bench.store.load(identity)
    row = bench.admin.execute(
        "SELECT lease_id, epoch, connector_id FROM mos_lease.logical_agent_connector_leases "
        "WHERE tenant_id = %s AND logical_agent_id = %s AND binding_id = %s",
        (identity.tenant_id, identity.logical_agent_id, identity.binding_id)).fetchone()
    seen = None if snapshot.row is None else (snapshot.row.lease_id, snapshot.row.epoch,
                                              snapshot.row.connector_id)
    if seen != (None if row is None else tuple(row)):
        tally.wrong.append(f"{where}: the store read {seen}, the database holds {row}")


async def _loss(bench: Bench, tally: Tally, rng: random.Random) -> None:
    """``cancel_on_loss``: a block looping on store calls, a rival's takeover confirmed on a
    notice; the block must end with ``LeaseLost`` within the call bound."""
    identity = bench.identity()
    lost_at: list[float] = []
    calls: list[float] = []
    holder = hold(bench.coordinator, identity, "me", scopes=SCOPES, ttl=10, cancel_on_loss=True,
                  callbacks=HoldCallbacks(on_lost=lambda _loss: lost_at.append(time.monotonic())))

    entered = asyncio.Event()
    over = [False]

    async def block() -> None:
        async with holder:
            entered.set()
            while not bench.stopping and not over[0]:  # as in _noise
                await bench.coordinator.current_holder(identity)
                calls.append(time.monotonic())

    noise = asyncio.ensure_future(_noise(bench, bench.noise_identity, 1, over))
    task = asyncio.ensure_future(block())
    async with asyncio.timeout(BOUND):
        await entered.wait()
    await asyncio.sleep(rng.uniform(0, 0.02))
    taken = await bench.rival.takeover(identity, "rival", scopes=SCOPES, ttl=30,
                                       expected_epoch=1)
    assert taken.ok and taken.lease is not None, taken
    holder._notice(identity, taken.lease.epoch)  # what the notice listener hands over
    ended = await _end(task)
    over[0] = True
    noise.cancel()
    await asyncio.wait((noise,), timeout=BOUND)
    tally.loss_trials += 1
    if ended is not None and not task.cancelled() \
            and isinstance(task.exception(), LeaseLost) and lost_at:
        tally.loss_raised += 1
        tally.loss_latencies.append(ended - lost_at[0])
        tally.calls_after_loss.append(sum(1 for t in calls if t > lost_at[0]))
    else:
        outcome = "running" if ended is None else ("cancelled" if task.cancelled()
                                                   else repr(task.exception()))
        tally.swallowed.append(f"{bench.source} cancel_on_loss #{bench.count}: {outcome}, "
                               f"{len(calls)} calls")


async def _fuzz(dsn: str, source: str, admin: psycopg.Connection[Any], prefix: str,
                trials: int, losses: int, tally: Tally) -> None:
    rng = random.Random(f"{SEED}-{source}")
    pool = (await open_async_pool(dsn, SETTINGS, min_size=2, max_size=2)
            if source == "pool" else None)
    store = (AsyncPostgresLeaseStore(pool=pool, settings=SETTINGS) if pool is not None
             else AsyncPostgresLeaseStore(dsn, settings=SETTINGS))
    rival_store = AsyncPostgresLeaseStore(dsn, settings=ConnectionSettings())
    bench = Bench(store, AsyncConnectorLeaseCoordinator(rival_store, AllowAllPolicy()),
                  admin, prefix, source)
    try:
        if pool is not None:
            await pool.wait()
        bench.noise_identity = bench.identity()
        await bench.lease(bench.noise_identity)
        before = tally.failures()
        for _ in range(trials // ROUND):
            if tally.failures() - before >= STOP:
                break
            await _round(bench, tally, rng, ROUND)
        before = tally.failures()
        for _ in range(losses):
            if tally.failures() - before >= STOP:
                break
            await _loss(bench, tally, rng)
    finally:
        bench.stopping = True
        await store.aclose()
        await rival_store.aclose()
        if pool is not None:
            await pool.close(timeout=2)


def test_cancellation_fuzz(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                           figures: Table) -> None:
    trials = scaled(soak, 750, 5000)  # per source
    losses = scaled(soak, 10, 100)
    prefix = run_prefix("s22")
    tally = Tally()
    for source in ("dedicated", "pool"):
        asyncio.run(_fuzz(pg_dsn, source, admin, prefix, trials, losses, tally))
    violations = check_history([], audit_rows(admin, prefix),
                               final_rows=final_rows(admin, prefix), audited=False)
    figures.counts("trials (2 sources)", 2 * trials, tally.trials)
    figures.add("entry points covered", f"{len(tally.entries)} of {len(ENTRIES)}", "all",
                len(tally.entries) == len(ENTRIES))
    figures.add("cancel() accepted", f"{tally.accepted} (+ {tally.noise_cancelled} "
                "concurrent calls)")
    figures.add("swallowed cancellations", len(tally.swallowed), "0", not tally.swallowed)
    figures.add("wrong outcomes", len(tally.wrong), "0", not tally.wrong)
    figures.add("history checker violations", len(violations), "0", not violations)
    figures.add("connections left mid-protocol", len(tally.mid_protocol), "0",
                not tally.mid_protocol)
    if tally.latencies:
        figures.add("cancel -> task ended, p99 / max (s)",
                    f"{percentile(tally.latencies, 0.99):.4f} / {max(tally.latencies):.4f}",
                    f"<= {BOUND:g}", max(tally.latencies) <= BOUND)
    figures.counts("cancel_on_loss trials", 2 * losses, tally.loss_trials)
    figures.add("ended with LeaseLost", f"{tally.loss_raised} of {tally.loss_trials}", "all",
                tally.loss_raised == tally.loss_trials)
    if tally.loss_latencies:
        figures.add("confirmed loss -> block ended, max (s)", f"{max(tally.loss_latencies):.4f}",
                    f"<= {BOUND:g}", max(tally.loss_latencies) <= BOUND)
        figures.add("store calls the block made after the loss, max",
                    max(tally.calls_after_loss))
    for name, items in (("swallowed", tally.swallowed), ("wrong", tally.wrong),
                        ("mid-protocol", tally.mid_protocol)):
        figures.notes += [f"{name}: {item}" for item in items[:5]]
    figures.notes += [f"violation: {v}" for v in violations[:5]]
    assert not figures.failed(), figures.render()
