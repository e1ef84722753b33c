"""The fleet's placement alone (``mos_lease.fleet.placement``): pure, no store, no I/O.

Measures, on 10,000 bindings: the CPU time of ``place()`` over three members (equal weights
and unequal ones), against a floor measured in the same run, hashing the same bindings once
(BLAKE2b, as ``place()`` must do at least); the CPU time of placing the same bindings again
after a member left, as a fleet member does (a ``Placer`` that keeps the bindings' order and
each member's scores), over that of ``place()``; the cost of one ``is_preferred`` lookup; and how
many bindings a join and a leave move, over the fair share of the member that joined or
left. Prints one JSON object::

    python bench/placement.py [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)

from mos_lease import LeaseIdentity
from mos_lease.fleet.placement import Placer, binding_digest, place

BINDINGS = 10_000


def _cpu_ms(work: Callable[[], object], repeats: int) -> float:
    """The median CPU time of ``work`` in ms (process time: what the other helpers' load on
    the machine does not add to)."""
    times = []
    for _ in range(repeats):
        start = time.process_time_ns()
        work()
        times.append((time.process_time_ns() - start) / 1e6)
    return statistics.median(times)


def run(repeats: int) -> dict[str, float]:
    bindings = [LeaseIdentity(f"tenant-{i % 20}", f"agent-{i}", "main")
                for i in range(BINDINGS)]
    three = ["gw-1", "gw-2", "gw-3"]
    floor = _cpu_ms(lambda: [binding_digest(b) for b in bindings], repeats)
    even = _cpu_ms(lambda: place(three, bindings), repeats)
    weighted = _cpu_ms(lambda: place({"gw-1": 1, "gw-2": 2, "gw-3": 1.5}, bindings), repeats)
    placer = Placer(bindings)
    placer.place(three)  # what a member placed before one left
    again = _cpu_ms(lambda: placer.place(three[1:]), repeats)
    placement = place(three, bindings)
    start = time.perf_counter_ns()
    for binding in bindings:
        placement.is_preferred(binding, "gw-1")
    lookup_us = (time.perf_counter_ns() - start) / 1e3 / BINDINGS
    before = placement.assignment()
    joined = place([*three, "gw-4"], bindings).assignment()
    left = place(three[1:], bindings).assignment()
    moved_join = sum(before[b] != joined[b] for b in bindings)
    moved_other_join = sum(before[b] != joined[b] != "gw-4" for b in bindings)
    moved_leave = sum(before[b] != left[b] for b in bindings)
    moved_other_leave = sum(before[b] != left[b] and before[b] != "gw-1" for b in bindings)
    return {
        "place_10k_x3_cpu_ms": round(even, 2),
        "place_10k_x3_weighted_cpu_ms": round(weighted, 2),
        "hash_10k_floor_cpu_ms": round(floor, 2),
        "place_10k_x3_vs_hash_floor": round(even / floor, 2),
        "replace_10k_3_to_2_cpu_ms": round(again, 2),
        "replace_vs_place": round(again / even, 2),
        "is_preferred_lookup_us": round(lookup_us, 3),
        "join_3_to_4_moved_vs_fair": round(moved_join / (BINDINGS / 4), 3),
        "join_3_to_4_moved_between_others": moved_other_join,
        "leave_3_to_2_moved_vs_fair": round(moved_leave / (BINDINGS / 3), 3),
        "leave_3_to_2_moved_between_others": moved_other_leave,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    figures = run(args.repeats)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
