"""Memory of the grant registry: RSS after minting and expiring many grants.

Runs in a fresh interpreter (``python bench/grant_memory.py --small N --large M`` prints one
JSON object), so nothing else the benchmark allocated is in the figure. Grants are minted
through ``GrantRegistry.mint`` exactly as the coordinator mints them, each with a short TTL
against a manual store clock that advances with every mint, so old grants keep expiring and
the registry must keep dropping them. RSS (``VmRSS``) is read after ``small`` grants and
again after ``large``, each time after the clock has passed every expiry.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta

import _path  # noqa: F401  (the repository's own mos_lease)
import attrs

from mos_lease import LeaseIdentity
from mos_lease.grants import GrantRegistry

STEP = timedelta(milliseconds=1)  # store time between two mints
TTL = timedelta(milliseconds=100)  # so about 100 grants are live at any time


@attrs.frozen
class MemoryResult:
    small: int
    large: int
    rss_small_mib: float
    rss_large_mib: float
    live_after: int

    @property
    def growth_mib(self) -> float:
        return self.rss_large_mib - self.rss_small_mib


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(small: int, large: int) -> dict[str, float]:
    registry = GrantRegistry()
    identity = LeaseIdentity("acme", "agent-7", "slack-main")
    lease_id = uuid.uuid4()
    scopes = ("tool:run", "tool:shell")
    now = datetime(2030, 1, 1, tzinfo=UTC)
    figures: dict[str, float] = {}
    minted = 0
    for target, key in ((small, "rss_small_mib"), (large, "rss_large_mib")):
        while minted < target:
            now += STEP
            registry.mint(uuid.uuid4(), identity, "claude-a", lease_id, 3, scopes, now + TTL,
                          "corr", now)
            minted += 1
        now += TTL + STEP  # every grant minted so far has expired by store time now
        registry.prune(now)
        gc.collect()
        figures[key] = rss_mib()
    figures["live_after"] = len(registry)
    return figures


def run(*, small: int, large: int) -> MemoryResult:
    """Measure in a fresh interpreter running this file."""
    done = subprocess.run([sys.executable, __file__, "--small", str(small), "--large",
                           str(large)], check=True, capture_output=True, text=True,
                          timeout=1800)
    figures = json.loads(done.stdout)
    return MemoryResult(small, large, figures["rss_small_mib"], figures["rss_large_mib"],
                        int(figures["live_after"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--small", type=int, required=True)
    parser.add_argument("--large", type=int, required=True)
    args = parser.parse_args()
    print(json.dumps(measure(args.small, args.large)))


if __name__ == "__main__":
    main()
