"""The pure core alone: ``mos_lease.machine.decide`` with no store, no I/O, no clock.

A fixed mix of decisions, allowed and refused, for every command kind: acquire of a free
and of a held identity, heartbeat by the holder and with a stale epoch, takeover of an
expired lease and an unpermitted preemption, release, and grant issue.
"""

from __future__ import annotations

import itertools
import statistics
import time
from datetime import UTC, datetime, timedelta
from uuid import UUID

import attrs

from mos_lease import LeaseIdentity
from mos_lease.machine import (
    ALLOW,
    Acquire,
    Command,
    Heartbeat,
    IssueGrant,
    PolicyVerdict,
    Release,
    Takeover,
    decide,
)
from mos_lease.records import LeaseRow

Inputs = tuple[LeaseRow | None, datetime, Command, PolicyVerdict]


@attrs.frozen
class CoreResult:
    decisions_per_s: float
    best_per_s: float
    mix: int


def _mix() -> list[Inputs]:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    ttl = timedelta(seconds=60)
    identity = LeaseIdentity("acme", "agent-7", "slack-main")
    lease_id, other = UUID(int=1), UUID(int=2)
    scopes = ("tool:run", "tool:shell")
    active = LeaseRow(identity, lease_id, "claude-a", scopes, 3, now - ttl, now - ttl,
                      now + ttl, None, now - ttl)
    expired = attrs.evolve(active, expires_at=now - timedelta(seconds=1))
    ids = (UUID(int=n) for n in itertools.count(100))
    return [
        (None, now, Acquire(identity, "claude-a", scopes, ttl, next(ids), next(ids), "c1"), ALLOW),
        (active, now, Acquire(identity, "claude-b", scopes, ttl, next(ids), next(ids), "c2"),
         ALLOW),
        (active, now, Heartbeat(identity, "claude-a", lease_id, 3, ttl, next(ids), "c3"), ALLOW),
        (active, now, Heartbeat(identity, "claude-a", other, 2, ttl, next(ids), "c4"), ALLOW),
        (expired, now, Takeover(identity, "claude-b", scopes, ttl, 3, False, next(ids),
                                next(ids), "c5"), ALLOW),
        (active, now, Takeover(identity, "claude-b", scopes, ttl, 3, False, next(ids),
                               next(ids), "c6"), ALLOW),
        (active, now, Release(identity, "claude-a", lease_id, 3, next(ids), "c7"), ALLOW),
        (active, now, IssueGrant(identity, "claude-a", lease_id, 3, ("tool:run",), ttl,
                                 next(ids), "c8"), ALLOW),
    ]


def run(*, decisions: int, repeats: int) -> CoreResult:
    mix = _mix()
    work = list(itertools.islice(itertools.cycle(mix), decisions))
    rates = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for row, now, command, verdict in work:
            decide(row, now, command, verdict)
        rates.append(decisions * 1e9 / (time.perf_counter_ns() - start))
    return CoreResult(statistics.median(rates), max(rates), len(mix))
