"""Timing: variants measured side by side, in interleaved rounds, on the same connection.

A *case* is one way of doing an operation (the library call, the raw statement it sends, a
naive implementation). Cases compared with each other run in the same rounds: every round
runs a block of each case, in an order that rotates from round to round, so a burst of noise
from the rest of a shared machine lands on all of them alike instead of on whichever ran
last. Work a case needs but that is not the operation itself (fresh identities to acquire,
leases to release, parameters for the raw statement) is prepared before its block, untimed.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence

import attrs


@attrs.define
class Case:
    """One variant. ``setup(n)`` runs untimed before each block of ``n`` calls; ``call(i)``
    is timed, one call per operation (``ops_per_call`` operations, e.g. leases per batch)."""

    name: str
    call: Callable[[int], None]
    setup: Callable[[int], None] = lambda _n: None
    ops_per_call: int = 1
    # Calls per round, when this case needs another count than the others (a batch of 100
    # leases per call runs fewer calls than the single heartbeat it is compared with).
    per_round: int | None = None


@attrs.define
class Series:
    """What one case measured: each call's latency and each round's block time."""

    name: str
    ops_per_call: int
    latencies_ns: list[int] = attrs.field(factory=list)
    block_ns: list[int] = attrs.field(factory=list)
    block_calls: list[int] = attrs.field(factory=list)

    @property
    def calls(self) -> int:
        return sum(self.block_calls)

    @property
    def ops_per_s(self) -> float:
        total = sum(self.block_ns)
        return math.nan if total == 0 else self.calls * self.ops_per_call * 1e9 / total

    def percentile_us(self, q: float) -> float:
        return percentile(self.latencies_ns, q) / 1000.0

    @property
    def p50_us(self) -> float:
        return self.percentile_us(50)

    @property
    def p99_us(self) -> float:
        return self.percentile_us(99)

    def round_rate(self, k: int) -> float:
        """Operations per second in round ``k``."""
        return self.block_calls[k] * self.ops_per_call * 1e9 / self.block_ns[k]


def percentile(values: Sequence[int], q: float) -> float:
    """The ``q``-th percentile (nearest rank on the sorted values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[rank - 1])


def throughput_ratio(a: Series, b: Series) -> float:
    """How fast ``a`` is relative to ``b``: the median over rounds of (a's rate / b's rate).

    Each round's two blocks ran back to back, so each per-round ratio compares the two under
    the same machine conditions; the median discards rounds a burst of outside load hit."""
    rounds = min(len(a.block_ns), len(b.block_ns))
    if rounds == 0:
        return math.nan
    return statistics.median(a.round_rate(k) / b.round_rate(k) for k in range(rounds))


def interleave(cases: Sequence[Case], *, rounds: int, per_round: int,
               warmup: int) -> dict[str, Series]:
    """Run ``warmup`` untimed calls of every case, then ``rounds`` rounds of ``per_round``
    timed calls of each, rotating the order of the cases from round to round."""
    for case in cases:
        n = warmup if case.per_round is None else min(warmup, case.per_round)
        if n:
            case.setup(n)
            for i in range(n):
                case.call(i)
    series = {case.name: Series(case.name, case.ops_per_call) for case in cases}
    clock = time.perf_counter_ns
    for k in range(rounds):
        shift = k % len(cases)
        for case in [*cases[shift:], *cases[:shift]]:
            n = per_round if case.per_round is None else case.per_round
            case.setup(n)
            gc.collect()
            latencies = series[case.name].latencies_ns
            call = case.call
            block_start = clock()
            for i in range(n):
                start = clock()
                call(i)
                latencies.append(clock() - start)
            series[case.name].block_ns.append(clock() - block_start)
            series[case.name].block_calls.append(n)
    return series
