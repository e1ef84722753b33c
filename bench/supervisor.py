"""The supervisor holding many bindings on PostgreSQL: threads and tasks, round trips per
renewal tick, and leases renewed per second against single heartbeats, in one run.

    python bench/supervisor.py [--bindings 10000] [--ttl 15] [--rounds 4] [--singles 100]
                               [--no-async] [--pool N]

Finds PostgreSQL as the tests do and works in a throwaway database. A :class:`Supervisor`
(then an :class:`AsyncSupervisor`) runs ``--bindings`` bindings in real time with the default
timing (renewal due every ``ttl / 3``); the store is wrapped to record every call.

* threads (sync) and tasks (asyncio) the library runs at once while it acquires and holds the
  bindings, counted exactly (every thread's ``run`` and every task of the loop is counted in
  and out), excluding the benchmark's own main thread and task;
* round trips per renewal tick: the store calls of one tick (a tick is a run of
  ``renew_many`` calls with no gap of ``--gap`` seconds between them), for every tick
  observed, and the leases they renewed;
* leases renewed per second: the leases of a tick over the time from the start of its first
  call to the end of its last; single heartbeats per second: ``--singles`` calls of
  ``coordinator.heartbeat`` on the same coordinator and store, one at a time, while no tick
  runs, before the round's tick; the ratio is the median over rounds of the per-round ratio.
  The floor beside it: one ``heartbeat_many`` of 1,000 of the leases called directly in the
  same round, so the supervisor's own cost shows apart from the batch call's.

With ``--pool N`` the store takes its connections from a pool of N (``make_pool``,
``open_async_pool``; minimum and maximum N) instead of its one dedicated connection: the
asyncio supervisor's two batches in flight then run on two backends at once. The pool's own
worker threads and tasks are counted with the library's.

Absolute rates on a shared machine are noise; the ratio is measured side by side.
Exit status: 0 ran, 2 could not run (no server), 3 a correctness check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import attrs
from common import SCOPES, BenchError, CorrectnessError, failed, server, throwaway_database

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseHandle,
    LeaseIdentity,
)
from mos_lease.supervisor import AsyncSupervisor, BindingLost, BindingStarted, Change, Supervisor
from mos_lease_pg import (
    AsyncPostgresLeaseStore,
    PostgresLeaseStore,
    make_pool,
    open_async_pool,
)

TARGETS = {"threads": 3, "round_trips": 11, "ratio": 10.0}


class Census:
    """How many threads started after :meth:`install` run at once (at most)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.alive = 0
        self.peak = 0
        self.started = 0
        self.names: list[str] = []  # the threads running at the peak
        self.running: list[threading.Thread] = []
        self._original = threading.Thread.run

    def install(self) -> None:
        original = self._original = threading.Thread.run
        census = self

        def run(thread: threading.Thread) -> None:
            with census.lock:
                census.alive += 1
                census.started += 1
                census.running.append(thread)
                if census.alive > census.peak:
                    census.peak = census.alive
                    census.names = sorted(t.name for t in census.running)
            try:
                original(thread)
            finally:
                with census.lock:
                    census.alive -= 1
                    census.running.remove(thread)

        threading.Thread.run = run  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        """Put ``Thread.run`` back: threads started later (another part of the benchmark's
        run) are not the supervisor's."""
        threading.Thread.run = self._original  # type: ignore[method-assign]


class TaskCensus:
    """How many tasks the running loop has at once, besides the benchmark's own."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0

    def install(self) -> None:
        loop = asyncio.get_running_loop()

        def factory(loop: asyncio.AbstractEventLoop, coro: Generator[Any, None, Any]
                    | Coroutine[Any, Any, Any], **kwargs: Any) -> asyncio.Task[Any]:
            task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, **kwargs)
            self.alive += 1
            self.peak = max(self.peak, self.alive)
            task.add_done_callback(self._done)
            return task

        loop.set_task_factory(factory)

    def _done(self, _task: asyncio.Task[Any]) -> None:
        self.alive -= 1


@attrs.define
class Call:
    name: str
    start: float
    end: float
    leases: int


class Recorder:
    """Wraps a store: every call is recorded (name, start, end, leases for ``renew_many``)."""

    def __init__(self, inner: Any, asynchronous: bool) -> None:
        self._inner = inner
        self._async = asynchronous
        self.calls: list[Call] = []
        self.running = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name.startswith("_") or not callable(attribute) or name == "close":
            return attribute
        batch = name == "renew_many"

        def size(args: tuple[Any, ...]) -> int:
            return len(args[0]) if batch else 0

        if self._async:
            async def recorded_async(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                self.running += 1
                try:
                    return await attribute(*args, **kwargs)
                finally:
                    self.running -= 1
                    self.calls.append(Call(name, start, time.perf_counter(), size(args)))

            return recorded_async

        def recorded(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self.running += 1
            try:
                return attribute(*args, **kwargs)
            finally:
                self.running -= 1
                self.calls.append(Call(name, start, time.perf_counter(), size(args)))

        return recorded

    def tick_done(self, gap: float) -> bool:
        """A tick has run and ended: renew_many calls recorded, none running, quiet since."""
        renewals = [c for c in self.calls if c.name == "renew_many"]
        return bool(renewals) and self.running == 0 and \
            time.perf_counter() - renewals[-1].end >= gap

    def quiet(self, gap: float) -> bool:
        """No call running, and none ended within ``gap`` seconds: no tick is under way."""
        return self.running == 0 and (not self.calls
                                      or time.perf_counter() - self.calls[-1].end >= gap)

    def take(self) -> list[Call]:
        calls, self.calls = self.calls, []
        return calls


@attrs.define
class Tick:
    round_trips: int
    leases: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.leases / self.seconds


def tick_of(calls: list[Call]) -> Tick:
    renewals = [c for c in calls if c.name == "renew_many"]
    # Every store call of the tick is a round trip: renewals, and anything else in it.
    first, last = renewals[0].start, renewals[-1].end
    inside = [c for c in calls if first <= c.start <= last]
    return Tick(len(inside), sum(c.leases for c in renewals), last - first)


@attrs.define
class Figures:
    kind: str
    bindings: int
    acquire_seconds: float
    peak: int
    names: list[str]
    ticks: list[Tick]
    singles: list[float]
    floors: list[float]  # heartbeat_many of up to 1,000 leases called directly, leases/s
    lost: int
    close_seconds: float

    def overhead(self) -> list[float]:
        return [t.rate / f for t, f in zip(self.ticks, self.floors, strict=False)]

    def ratios(self) -> list[float]:
        return [t.rate / s for t, s in zip(self.ticks, self.singles, strict=False)]


def identities(tenant: str, n: int) -> list[LeaseIdentity]:
    return [LeaseIdentity(tenant, f"agent-{i}", "main") for i in range(n)]


def wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise CorrectnessError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Tally:
    """The changes the benchmark counts: bindings started, and the losses reported."""

    def __init__(self) -> None:
        self.started = 0
        self.lost: list[Change] = []

    def __call__(self, change: Change) -> None:
        if isinstance(change, BindingStarted):
            self.started += 1
        elif isinstance(change, BindingLost):
            self.lost.append(change)


def run_sync(dsn: str, args: Size) -> Figures:
    census = Census()
    census.install()
    try:
        return _run_sync(dsn, args, census)
    finally:
        census.uninstall()


def _run_sync(dsn: str, args: Size, census: Census) -> Figures:
    pool = make_pool(dsn, min_size=args.pool, max_size=args.pool) if args.pool else None
    store = PostgresLeaseStore(pool=pool) if pool is not None else PostgresLeaseStore(dsn)
    recorder = Recorder(store, asynchronous=False)
    coordinator = ConnectorLeaseCoordinator(recorder, AllowAllPolicy())
    tally = Tally()

    names = identities("bench-sync", args.bindings)
    supervisor = Supervisor(coordinator, on_change=tally)
    t0 = time.perf_counter()
    for identity in names:
        supervisor.add(identity, "bench-gw", scopes=SCOPES, ttl=args.ttl)
    wait(lambda: tally.started == args.bindings, 900, "every binding to be held")
    acquire_seconds = time.perf_counter() - t0
    held = [supervisor.lease(i) for i in names[:1000]]
    handles = [h for h in held if h is not None]
    if len(handles) != len(held):
        raise CorrectnessError("a binding reported started holds no lease")
    recorder.take()
    ticks, singles, floors = [], [], []
    for _ in range(args.rounds):
        # Singles and the floor while no tick runs; then a whole tick of its own.
        wait(lambda: recorder.quiet(args.gap), 4 * args.ttl, "a quiet moment")
        singles.append(single_rate(coordinator, handles[:args.singles], args.ttl))
        t = time.perf_counter()
        coordinator.heartbeat_many(handles, ttl=args.ttl)
        floors.append(len(handles) / (time.perf_counter() - t))
        wait(lambda: recorder.quiet(args.gap), 4 * args.ttl, "a quiet moment")
        recorder.take()
        wait(lambda: recorder.tick_done(args.gap), 4 * args.ttl, "a renewal tick")
        ticks.append(tick_of(recorder.take()))
    t1 = time.perf_counter()
    supervisor.close(timeout=60)
    close_seconds = time.perf_counter() - t1
    store.close()
    if pool is not None:
        pool.close()
    return Figures("sync", args.bindings, acquire_seconds, census.peak, census.names, ticks,
                   singles, floors,
                   len(tally.lost) - args.bindings, close_seconds)


def single_rate(coordinator: ConnectorLeaseCoordinator, handles: list[LeaseHandle],
                ttl: float) -> float:
    t = time.perf_counter()
    for handle in handles:
        if not coordinator.heartbeat(handle, ttl=ttl).ok:
            raise CorrectnessError("a single heartbeat of a held lease was refused")
    return len(handles) / (time.perf_counter() - t)


async def run_async(dsn: str, args: Size) -> Figures:
    census = TaskCensus()
    census.install()
    pool = (await open_async_pool(dsn, min_size=args.pool, max_size=args.pool)
            if args.pool else None)
    store = (AsyncPostgresLeaseStore(pool=pool) if pool is not None
             else AsyncPostgresLeaseStore(dsn))
    recorder = Recorder(store, asynchronous=True)
    coordinator = AsyncConnectorLeaseCoordinator(recorder, AllowAllPolicy())
    tally = Tally()

    async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > end:
                raise CorrectnessError(f"timed out waiting for {what}")
            await asyncio.sleep(0.01)

    names = identities("bench-async", args.bindings)
    supervisor = AsyncSupervisor(coordinator, on_change=tally)
    t0 = time.perf_counter()
    for identity in names:
        supervisor.add(identity, "bench-gw", scopes=SCOPES, ttl=args.ttl)
    await until(lambda: tally.started == args.bindings, 900, "every binding to be held")
    acquire_seconds = time.perf_counter() - t0
    held = [supervisor.lease(i) for i in names[:1000]]
    handles = [h for h in held if h is not None]
    if len(handles) != len(held):
        raise CorrectnessError("a binding reported started holds no lease")
    recorder.take()
    ticks, singles, floors = [], [], []
    for _ in range(args.rounds):
        await until(lambda: recorder.quiet(args.gap), 4 * args.ttl, "a quiet moment")
        t = time.perf_counter()
        for handle in handles[:args.singles]:
            if not (await coordinator.heartbeat(handle, ttl=args.ttl)).ok:
                raise CorrectnessError("a single heartbeat of a held lease was refused")
        singles.append(args.singles / (time.perf_counter() - t))
        t = time.perf_counter()
        await coordinator.heartbeat_many(handles, ttl=args.ttl)
        floors.append(len(handles) / (time.perf_counter() - t))
        await until(lambda: recorder.quiet(args.gap), 4 * args.ttl, "a quiet moment")
        recorder.take()
        await until(lambda: recorder.tick_done(args.gap), 4 * args.ttl, "a renewal tick")
        ticks.append(tick_of(recorder.take()))
    t1 = time.perf_counter()
    await supervisor.close()
    close_seconds = time.perf_counter() - t1
    await store.aclose()
    if pool is not None:
        await pool.close()
    return Figures("async", args.bindings, acquire_seconds, census.peak, [], ticks, singles,
                   floors,
                   len(tally.lost) - args.bindings, close_seconds)


def report(figures: Figures) -> list[str]:
    unit = "threads" if figures.kind == "sync" else "tasks"
    n = figures.bindings
    lines = [f"[{figures.kind}] {n:,} bindings held in {figures.acquire_seconds:.1f} s "
             f"(acquired one by one); closed (all released) in {figures.close_seconds:.1f} s",
             f"[{figures.kind}] {unit} the library ran at once, at most: {figures.peak} "
             f"(target <= {TARGETS['threads']})"
             + (f": {', '.join(figures.names)}" if figures.names else "")]
    for k, (tick, single, floor) in enumerate(zip(figures.ticks, figures.singles,
                                                  figures.floors, strict=False)):
        lines.append(f"[{figures.kind}] tick {k + 1}: {tick.round_trips} round trip(s) renewed "
                     f"{tick.leases:,} leases in {tick.seconds * 1000:.0f} ms = "
                     f"{tick.rate:,.0f} leases/s; single heartbeats {single:,.0f}/s (ratio "
                     f"{tick.rate / single:.1f}); heartbeat_many of 1,000 called directly "
                     f"{floor:,.0f}/s (ratio {tick.rate / floor:.2f})")
    full = [t for t in figures.ticks if t.leases == n]
    trips = max((t.round_trips for t in full), default=None)
    ratio = statistics.median(figures.ratios())
    lines += [
        f"[{figures.kind}] supervisor_renewal_round_trips_{n // 1000}k: "
        f"{'-' if trips is None else trips} per tick renewing all {n:,} leases "
        f"({len(full)} of {len(figures.ticks)} ticks renewed them all; target <= "
        f"{TARGETS['round_trips']} for 10k)",
        f"[{figures.kind}] supervisor_leases_per_s: median "
        f"{statistics.median(t.rate for t in figures.ticks):,.0f}/s vs single heartbeats "
        f"{statistics.median(figures.singles):,.0f}/s: ratio {ratio:.1f} (median of "
        f"per-round ratios; target >= {TARGETS['ratio']:g})",
        f"[{figures.kind}] supervisor over heartbeat_many called directly: median ratio "
        f"{statistics.median(figures.overhead()):.2f} "
        "(what the supervisor adds to the batch call itself)",
        f"[{figures.kind}] losses other than the closing ones: {figures.lost}",
    ]
    return lines


@attrs.frozen
class Summary:
    """The three figures of the issue, over both kinds (the worse of the two where they
    differ), as ``bench/run.py`` reports them."""

    bindings: int
    peak: int  # threads (sync) or tasks (asyncio) the library ran at once, the larger
    # Round trips of one renewal tick, the most over every tick observed (a tick that renewed
    # only some leases makes fewer; full_ticks says how many renewed them all).
    round_trips: int
    full_ticks: int
    leases_per_s: float  # median over ticks, the slower kind
    singles_per_s: float  # median single heartbeats per second, the same kind
    ratio: float  # median of per-round ratios to single heartbeats, the lower kind
    overhead: float  # supervisor tick over heartbeat_many called directly, the lower kind
    per_kind: list[Figures]


def summarize(results: list[Figures]) -> Summary:
    ticks = [t for f in results for t in f.ticks]
    slowest = min(results, key=lambda f: statistics.median(t.rate for t in f.ticks))
    return Summary(
        bindings=results[0].bindings,
        peak=max(f.peak for f in results),
        round_trips=max(t.round_trips for t in ticks),
        full_ticks=sum(t.leases == f.bindings for f in results for t in f.ticks),
        leases_per_s=statistics.median(t.rate for t in slowest.ticks),
        singles_per_s=statistics.median(slowest.singles),
        ratio=min(statistics.median(f.ratios()) for f in results),
        overhead=min(statistics.median(f.overhead()) for f in results),
        per_kind=results)


@attrs.frozen
class Size:
    """How much one run holds and for how long."""

    bindings: int
    ttl: float = 15.0
    rounds: int = 4
    singles: int = 100
    gap: float = 0.5  # seconds without a renewal that end a tick
    asynchronous: bool = True  # the AsyncSupervisor as well as the Supervisor
    pool: int = 0  # connections of a pool for the store; 0: its one dedicated connection


# The size; and bench/run.py --quick's: just enough bindings for two renewal round
# trips a tick (BATCH is 1,000), a TTL as short as the default safety margin allows
# (renewals every 2 s), so that the quick run stays short on a busy machine.
FULL_SIZE = Size(10_000)
QUICK_SIZE = Size(1_200, ttl=6.0, rounds=2, singles=50, gap=0.3)


def run(dsn: str, size: Size) -> Summary:
    """Both supervisors (the asyncio one unless ``size.asynchronous`` is false), one after
    the other on the migrated database ``dsn``; raises :class:`CorrectnessError` if a
    binding was lost while the store was healthy."""
    results = [run_sync(dsn, size)]
    if size.asynchronous:
        results.append(asyncio.run(run_async(dsn, size)))
    if any(r.lost for r in results):
        raise CorrectnessError("a binding was lost while the store was healthy")
    return summarize(results)


def parse_args(argv: list[str] | None) -> Size:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bindings", type=int, default=FULL_SIZE.bindings)
    parser.add_argument("--ttl", type=float, default=FULL_SIZE.ttl)
    parser.add_argument("--rounds", type=int, default=FULL_SIZE.rounds)
    parser.add_argument("--singles", type=int, default=FULL_SIZE.singles)
    parser.add_argument("--gap", type=float, default=FULL_SIZE.gap,
                        help="seconds without a renewal that end a tick")
    parser.add_argument("--no-async", action="store_true")
    parser.add_argument("--pool", type=int, default=0,
                        help="take the store's connections from a pool of this many")
    args = parser.parse_args(argv)
    if args.bindings < 1 or args.rounds < 1 or args.singles < 1:
        parser.error("--bindings, --rounds and --singles must be at least 1")
    if args.pool < 0:
        parser.error("--pool must not be negative")
    return Size(args.bindings, ttl=args.ttl, rounds=args.rounds,
                singles=min(args.singles, args.bindings), gap=args.gap,
                asynchronous=not args.no_async, pool=args.pool)


def main(argv: list[str] | None = None) -> int:
    size = parse_args(argv)
    try:
        srv = server()
        store = f"a pool of {size.pool}" if size.pool else "one dedicated connection"
        print(f"mos-lease supervisor benchmark: {size.bindings:,} bindings, ttl {size.ttl:g} s,"
              f" {size.rounds} rounds, the store on {store}; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        with throwaway_database(srv, "mos_lease_bench_sup") as dsn:
            results = [run_sync(dsn, size)]
            for line in report(results[0]):
                print(line, flush=True)
            if size.asynchronous:
                results.append(asyncio.run(run_async(dsn, size)))
                for line in report(results[1]):
                    print(line, flush=True)
        print(f"load average at end {os.getloadavg()[0]:.2f} (a shared machine: absolute "
              "rates are noise; compare the ratios)")
        if any(r.lost for r in results):
            raise CorrectnessError("a binding was lost while the store was healthy")
    except (BenchError, CorrectnessError) as error:
        return failed(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
