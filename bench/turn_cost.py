"""What one notice-triggered supervisor turn costs in CPU, at 1,000 and at 10,000 bindings.

    python bench/turn_cost.py [--small 1000] [--large 10000] [--notices 200]

A :class:`~mos_lease.supervisor.Supervisor` on the in-memory store (so the figure is the
client's work alone, with no server to share the cores with) runs N bindings on a manual
clock with a notice source: half of them it holds, half are held by another connector, which
it waits for. Then, one at a time, a notice comes for a different waiting binding: the notice
moves that binding's read into the next turn (``Schedule.look``), and the supervisor turns
until it sleeps again (one turn reads the holder, the next finds nothing due). The CPU time
of the calling thread from the notice to the sleep is one sample; nothing else is due
meanwhile (renewals come a third of the ttl later than the clock ever gets), so the work
that must be done is the same at both sizes: one binding's read.

``turn_cpu_10k_vs_1k`` = the median sample at ``large`` over the median at ``small``: 1 for
a turn that costs what is due in it, ``large / small`` for one that looks at every binding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import attrs

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.supervisor import Supervisor
from mos_lease.testing import ManualNoticeFeed
from mos_lease_memory import InMemoryLeaseStore

TTL = 120.0  # renewals due at ttl / 3 (40 s; early ones from 20 s): never within the run
SCOPES = ("tools:read",)


@attrs.frozen
class TurnCostResult:
    small: int
    large: int
    small_ms: float  # median CPU ms of one notice-triggered turn (and the turn that sleeps)
    large_ms: float
    notices: int

    @property
    def ratio(self) -> float:
        return self.large_ms / self.small_ms


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _identity(n: int) -> LeaseIdentity:
    return LeaseIdentity("bench", f"agent-{n}", f"binding-{n}")


def samples(bindings: int, notices: int) -> list[float]:
    """CPU seconds of each of ``notices`` notice-triggered turns over ``bindings``."""
    clock = _Clock()
    store = InMemoryLeaseStore()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy(), monotonic_clock=clock)
    rival = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    waiting = [_identity(n) for n in range(1, bindings, 2)]  # held by the rival
    for first in range(0, len(waiting), 1000):
        rival.acquire_many(waiting[first:first + 1000], "gw-b", scopes=SCOPES, ttl=TTL)
    sleeps: list[float] = []
    feed = ManualNoticeFeed()
    supervisor = Supervisor(coordinator, clock=clock, sleep=sleeps.append,
                            random=lambda: 0.5, background=False, notices=feed)
    try:
        for n in range(bindings):
            supervisor.add(_identity(n), "gw-a", scopes=SCOPES, ttl=TTL)

        def settle() -> None:
            before = len(sleeps)
            while len(sleeps) == before:
                supervisor.turn()

        settle()
        held = sum(supervisor.lease(_identity(n)) is not None for n in range(0, bindings, 2))
        if held != (bindings + 1) // 2:
            raise AssertionError(f"{held} of {(bindings + 1) // 2} bindings held")
        # Past max_backoff (2 s) since each waiting binding's read: a notice moves its next
        # read to now (Schedule.look never moves it sooner than that).
        clock.now += 2.5
        reads = supervisor.stats().campaign_reads
        out: list[float] = []
        for identity in waiting[:notices]:
            started = time.thread_time()
            feed.send(identity, 1, "release")
            settle()
            out.append(time.thread_time() - started)
        # Each notice cost exactly one binding's read, and nothing else was done.
        if supervisor.stats().campaign_reads - reads != len(out):
            raise AssertionError("a notice-triggered turn did not read exactly one binding")
        return out
    finally:
        supervisor.close()


def run(small: int = 1_000, large: int = 10_000, notices: int = 200) -> TurnCostResult:
    notices = min(notices, small // 2)
    medians = [statistics.median(samples(n, notices)) * 1e3 for n in (small, large)]
    return TurnCostResult(small, large, medians[0], medians[1], notices)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/turn_cost.py", description=__doc__)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--large", type=int, default=10_000)
    parser.add_argument("--notices", type=int, default=200)
    args = parser.parse_args(argv)
    result = run(args.small, args.large, args.notices)
    print(f"notice-triggered turn, median CPU of {result.notices}: "
          f"{result.small:,} bindings {result.small_ms:.3f} ms, "
          f"{result.large:,} bindings {result.large_ms:.3f} ms; "
          f"turn_cpu_10k_vs_1k = {result.ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
