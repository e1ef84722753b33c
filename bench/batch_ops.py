"""Batched acquires, takeovers and releases against their single calls, on PostgreSQL.

    python bench/batch_ops.py [--size 1000] [--singles 300] [--rounds 1]

Finds PostgreSQL as the tests do and works in a throwaway database. Each round a first
gateway acquires ``2 * size`` bindings, half with ``acquire_many`` (batches of ``size``),
``singles`` of the rest with ``acquire`` one by one; a survivor reads the holders
(``current_holders``, not timed) and takes ``size`` of them over with one ``takeover_many``
and ``singles`` with ``takeover`` one by one (each given its view, so each single takeover
is one round trip, as the batch is); then it releases them the same two ways. Printed: items
per second of each, and the batch / single ratio (``batch_<op>_vs_single``), the median over
rounds. Every item must succeed (exit status 3 otherwise). Absolute rates on a shared
machine are noise; the ratios are measured side by side. Exit status: 0 ran, 2 could not
run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
from common import SCOPES, BenchError, CorrectnessError, failed, server, throwaway_database

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity, LeaseResult
from mos_lease.checks import MAX_BATCH
from mos_lease_pg import PostgresLeaseStore

OPERATIONS = ("acquire", "takeover", "release")


def _ok(results: Sequence[LeaseResult], what: str) -> None:
    refused = [r for r in results if not r.ok]
    if refused:
        raise CorrectnessError(f"{what}: {len(refused)} refused, e.g. {refused[0]}")


def _rate(count: int, run: Callable[[], Sequence[LeaseResult]], what: str) -> float:
    began = time.perf_counter()
    results = run()
    took = time.perf_counter() - began
    _ok(results, what)
    return count / took


def one_round(dsn: str, round_: int, size: int, singles: int) -> dict[str, float]:
    """Items per second of each operation, batched and single, in one round."""
    rates: dict[str, float] = {}
    with PostgresLeaseStore(dsn) as first_store, PostgresLeaseStore(dsn) as second_store:
        first = ConnectorLeaseCoordinator(first_store, AllowAllPolicy())
        survivor = ConnectorLeaseCoordinator(second_store, AllowAllPolicy())
        batch = [LeaseIdentity(f"bench-{round_}", "agent", f"b{i}") for i in range(size)]
        alone = [LeaseIdentity(f"bench-{round_}", "agent", f"s{i}") for i in range(singles)]

        rates["acquire_batch"] = _rate(size, lambda: first.acquire_many(
            batch, "gw-1", scopes=SCOPES, ttl=60), "acquire_many")
        rates["acquire_single"] = _rate(singles, lambda: [
            first.acquire(key, "gw-1", scopes=SCOPES, ttl=60) for key in alone], "acquire")

        batch_views = survivor.current_holders(batch)
        alone_views = survivor.current_holders(alone)
        taken: list[LeaseResult] = []
        taken_alone: list[LeaseResult] = []

        def takeover_batch() -> Sequence[LeaseResult]:
            taken.extend(survivor.takeover_many([(key, 1) for key in batch], "gw-2",
                                                scopes=SCOPES, ttl=60, observed=batch_views))
            return taken

        def takeover_single() -> Sequence[LeaseResult]:
            taken_alone.extend(survivor.takeover(key, "gw-2", scopes=SCOPES, ttl=60,
                                                 expected_epoch=1, observed=view)
                               for key, view in zip(alone, alone_views, strict=True))
            return taken_alone

        rates["takeover_batch"] = _rate(size, takeover_batch, "takeover_many")
        rates["takeover_single"] = _rate(singles, takeover_single, "takeover")

        held = [r.lease for r in taken if r.lease is not None]
        held_alone = [r.lease for r in taken_alone if r.lease is not None]
        rates["release_batch"] = _rate(size, lambda: survivor.release_many(held),
                                       "release_many")
        rates["release_single"] = _rate(singles, lambda: [survivor.release(lease)
                                                          for lease in held_alone], "release")
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=MAX_BATCH,
                        help=f"items per batch (at most {MAX_BATCH}; default {MAX_BATCH})")
    parser.add_argument("--singles", type=int, default=300,
                        help="items made one call each (default 300)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds (default 1)")
    args = parser.parse_args()
    if not 1 <= args.size <= MAX_BATCH or args.singles < 1 or args.rounds < 1:
        parser.error(f"--size must be 1..{MAX_BATCH}; --singles and --rounds at least 1")
    try:
        srv = server()
        with throwaway_database(srv, "mos_lease_bench_batch") as dsn:
            rounds = [one_round(dsn, r, args.size, args.singles) for r in range(args.rounds)]
    except (BenchError, CorrectnessError) as error:
        return failed(error)
    print(f"batch of {args.size} vs {args.singles} single calls, {args.rounds} round(s)")
    for op in OPERATIONS:
        batch = statistics.median(r[f"{op}_batch"] for r in rounds)
        single = statistics.median(r[f"{op}_single"] for r in rounds)
        ratio = statistics.median(r[f"{op}_batch"] / r[f"{op}_single"] for r in rounds)
        print(f"  {op:8s}  batch {batch:9.0f}/s  single {single:7.0f}/s  "
              f"batch_{op}_vs_single {ratio:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
