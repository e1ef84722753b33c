"""Threads validating on one coordinator: which store to give it, measured side by side.

    python bench/threads.py [--threads 8] [--pools 2,4,8] [--io-ms 0,2] [--latency-ms 0,1]
                            [--rounds 5] [--seconds 1]

Finds PostgreSQL as the tests do and works in a throwaway database. ``--threads`` threads
(a threaded WSGI server's workers) share **one** :class:`ConnectorLeaseCoordinator` (grants
are process-local: only the coordinator that minted a grant accepts it) and each serves
requests in a loop: optional work of its own that releases the GIL (``--io-ms``, a sleep
standing for the request's other I/O), then ``coordinator.validate`` of one grant. The
coordinator's store is, in turn:

* ``dedicated``: ``PostgresLeaseStore(dsn)``, one connection the threads take turns on;
* ``pool k``: ``PostgresLeaseStore(pool=make_pool(dsn, max_size=k))`` for each ``--pools``.

With ``--latency-ms`` above 0 every connection goes through a relay in this process
(``tests.pg_support.FaultProxy``) that holds each reply that long: a database across a
network, where a round trip, not the server's work, is what threads wait for.

Each round runs every store for ``--seconds`` seconds, the order rotating from round to
round; a ratio is the median over rounds of the per-round ratio against ``dedicated``. The
floor beside them: one thread validating on the dedicated store, in the same round.
Also shown, as a check: a grant minted by one coordinator and validated by a second over the
same database is refused (``grant_unknown``): "a coordinator per thread" refuses every grant.

Absolute rates on a shared machine are noise; the ratios are measured side by side.
Exit status: 0 ran, 2 could not run (no server), 3 a correctness check failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
from common import SCOPES, BenchError, CorrectnessError, failed, server, throwaway_database

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity, Reason
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore, make_pool
from tests.pg_support import FaultProxy

IDENTITY = LeaseIdentity("bench", "threads", "b")


@contextmanager
def coordinators(dsn: str, pools: list[int]) -> Iterator[dict[str, ConnectorLeaseCoordinator]]:
    """One coordinator per store kind, each holding the lease of its own identity."""
    settings = ConnectionSettings()
    with ExitStack() as stack:
        stores: dict[str, PostgresLeaseStore] = {
            "dedicated": stack.enter_context(PostgresLeaseStore(dsn, settings=settings))}
        for size in pools:
            pool = make_pool(dsn, settings, min_size=size, max_size=size)
            stack.callback(pool.close)
            stores[f"pool {size}"] = stack.enter_context(
                PostgresLeaseStore(pool=pool, settings=settings))
        yield {name: ConnectorLeaseCoordinator(store, AllowAllPolicy())
               for name, store in stores.items()}


def serve(coordinator: ConnectorLeaseCoordinator, identity: LeaseIdentity, threads: int,
          seconds: float, io: float) -> float:
    """Requests per second of ``threads`` threads serving for ``seconds`` on ``coordinator``."""
    lease = coordinator.acquire(identity, "bench", scopes=SCOPES, ttl=60).lease
    if lease is None:  # held from an earlier round: renew it instead
        view = coordinator.current_holder(identity)
        assert view is not None
        lease = coordinator.takeover(identity, "bench", scopes=SCOPES, ttl=60,
                                     expected_epoch=view.epoch, observed=view).lease
    if lease is None:
        raise CorrectnessError(f"could not hold {identity}")
    grant = coordinator.issue_grant(lease, scopes=SCOPES, ttl=30).grant
    if grant is None:
        raise CorrectnessError("no grant")
    counts = [0] * threads
    failures: list[str] = []
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def worker(slot: int) -> None:
        start.wait()
        done = 0
        while not stop.is_set():
            if io:
                time.sleep(io)
            result = coordinator.validate(grant, identity=identity, scopes=SCOPES)
            if not result.ok:
                failures.append(str(result.reason))
                return
            done += 1
        counts[slot] = done

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in workers:
        thread.join()
    elapsed = time.perf_counter() - began
    if failures:
        raise CorrectnessError(f"validation refused: {failures[0]}")
    return sum(counts) / elapsed


def one_coordinator_per_thread(dsn: str) -> Reason | None:
    """What a second coordinator says of the first one's grant."""
    with PostgresLeaseStore(dsn) as first_store, PostgresLeaseStore(dsn) as second_store:
        first = ConnectorLeaseCoordinator(first_store, AllowAllPolicy())
        second = ConnectorLeaseCoordinator(second_store, AllowAllPolicy())
        identity = LeaseIdentity("bench", "per-thread", "b")
        lease = first.acquire(identity, "bench", scopes=SCOPES, ttl=60).lease
        assert lease is not None
        grant = first.issue_grant(lease, scopes=SCOPES, ttl=30).grant
        assert grant is not None
        return second.validate(grant, identity=identity, scopes=SCOPES).reason


def measure(direct: str, args: argparse.Namespace) -> None:
    pools = [int(k) for k in args.pools.split(",")]
    cases = [(float(latency), float(io)) for latency in args.latency_ms.split(",")
             for io in args.io_ms.split(",")]
    for latency_ms, io_ms in cases:
        io = io_ms / 1000
        with ExitStack() as relay:
            dsn = direct
            if latency_ms:
                proxy = FaultProxy(direct)
                relay.callback(proxy.close)
                proxy.delay_replies(latency_ms / 1000)
                dsn = proxy.dsn
            by_store = relay.enter_context(coordinators(dsn, pools))
            names = list(by_store)
            rates: dict[str, list[float]] = {name: [] for name in [*names, "1 thread"]}
            for round_ in range(args.rounds):
                order = names[round_ % len(names):] + names[:round_ % len(names)]
                for name in order:
                    identity = LeaseIdentity("bench", f"threads-{name.replace(' ', '-')}", "b")
                    rates[name].append(serve(by_store[name], identity, args.threads,
                                             args.seconds, io))
                rates["1 thread"].append(serve(by_store["dedicated"], IDENTITY, 1,
                                               args.seconds, io))
        print(f"\n{args.threads} threads on one coordinator, {latency_ms:g} ms added to each "
              f"round trip, {io_ms:g} ms of other I/O per request, {args.rounds} rounds of "
              f"{args.seconds:g} s")
        print(f"{'store':<12} {'req/s (median)':>15} {'vs dedicated (median ratio)':>28}")
        for name, series in rates.items():
            ratios = [r / d for r, d in zip(series, rates["dedicated"], strict=True)]
            print(f"{name:<12} {statistics.median(series):>15.0f} "
                  f"{statistics.median(ratios):>28.2f}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--pools", default="2,4,8", help="pool sizes, separated by commas")
    parser.add_argument("--io-ms", default="0,2",
                        help="other I/O per request in ms (a sleep), separated by commas")
    parser.add_argument("--latency-ms", default="0",
                        help="delay added to each reply in ms (a relay), separated by commas")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args(argv)
    try:
        srv = server()
        with throwaway_database(srv, "mos_lease_bench_threads") as dsn:
            reason = one_coordinator_per_thread(dsn)
            print(f"a grant validated by another coordinator: {reason}")
            if reason is not Reason.GRANT_UNKNOWN:
                raise CorrectnessError(f"another coordinator said {reason}")
            measure(dsn, args)
    except (BenchError, CorrectnessError) as error:
        return failed(error)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
