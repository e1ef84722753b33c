"""The fleet run by thread supervisors on PostgreSQL, in one process, each member with its
own store connection and its own notice listener, in real time: a second and a third member
join and get balanced shares within the cap by planned hand-offs, one leaves gracefully
(close()), one crashes (stops renewing) and the others take over after expiry. The policy
allows preemption and records every takeover asked of an active lease: the fleet must ask
none. The audit log shows each binding's epochs going up by one, one takeover per move."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from mos_lease import ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.fleet.membership import HANDOFF_PREFIX, Fleet
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.supervisor import Change, Moved, Supervisor
from mos_lease.testing.fleet_world import RecordingPolicy
from mos_lease.vocabulary import Outcome
from mos_lease_pg import LeaseNotices
from tests.fleet_check import MemberRig
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

TTL, LOOK, GRACE = 4.0, 0.5, 2.0
BINDINGS = 300
NAMES = ["m1", "m2", "m3"]


class Members(MemberRig):
    def __init__(self, stores: StoreFactory, dsn: str, fleet: str,
                 bindings: list[LeaseIdentity], stack: ExitStack) -> None:
        self.policy = RecordingPolicy()
        super().__init__(ConnectorLeaseCoordinator(stores(), self.policy), bindings, TTL, stack)
        self.stores, self.dsn, self.fleet = stores, dsn, fleet
        self.changes: dict[str, list[Change]] = {}

    def start(self, name: str) -> Supervisor:
        notices = self.stack.enter_context(LeaseNotices(self.dsn, confirmer=NoticeConfirmer()))
        assert notices.listening.wait(5), notices.refused
        return self.join(name, Supervisor(
            ConnectorLeaseCoordinator(self.stores(), self.policy), notices=notices,
            on_change=self.changes.setdefault(name, []).append,
            fleet=Fleet(self.fleet, name, members=NAMES, ttl=TTL, look=LOOK, grace=GRACE,
                        endpoint=f"{name}.internal:8443")))

    def taken_over(self) -> Counter[LeaseIdentity]:
        return Counter({b: sum(r.entry.outcome is Outcome.TAKEN_OVER
                               for r in self.reader.store.audit(b))  # type: ignore[attr-defined]
                        for b in self.bindings})


def balanced(names: set[str], bindings: int) -> Callable[[Counter[str | None]], bool]:
    cap = math.ceil(1.1 * bindings / len(names))
    return lambda shares: set(shares) == names and max(shares.values()) <= cap


def crash(supervisor: Supervisor) -> None:
    """Stop the supervisor's thread without releasing anything: it stops renewing, as a
    killed process does (its leases run out at their ttl)."""
    with supervisor._core.lock:
        supervisor._core.closing = True
    supervisor._wakeup.set()
    supervisor._worker.stop(10)


@pytest.fixture
def members(pg_stores: StoreFactory, pg_dsn: str, pg_tenant: str) -> Iterator[Members]:
    bindings = [LeaseIdentity(pg_tenant, f"agent-{n}", "main") for n in range(BINDINGS)]
    with ExitStack() as stack:
        yield Members(pg_stores, pg_dsn, pg_tenant, bindings, stack)


def test_join_leave_and_crash_on_postgresql(members: Members) -> None:
    members.start("m1")
    members.wait_for(lambda s: s == {"m1": BINDINGS}, 20)
    joined = time.monotonic()
    members.start("m2")
    members.wait_for(balanced({"m1", "m2"}, BINDINGS), 10)
    members.start("m3")
    shares = members.wait_for(balanced(set(NAMES), BINDINGS), 10)
    joins_took = time.monotonic() - joined
    moved = Counter(c.identity for name in NAMES for c in members.changes[name]
                    if isinstance(c, Moved))
    taken = members.taken_over()
    # Every takeover so far is a planned hand-off, and each moved binding was taken over
    # exactly once per move (its holder released it naming the successor).
    assert taken == moved and sum(moved.values()) >= shares["m2"] + shares["m3"]
    for binding in list(moved)[:20]:
        released = [r.entry for r in members.reader.store.audit(binding)  # type: ignore[attr-defined]
                    if r.entry.outcome is Outcome.RELEASED]
        assert released and all(e.correlation_id.startswith(HANDOFF_PREFIX) for e in released)
    status = members.running["m1"].fleet_status()
    assert status is not None and status.view is not None
    assert [(m.name, m.endpoint) for m in status.view.members] == [
        (n, f"{n}.internal:8443") for n in NAMES]

    left = time.monotonic()
    members.running.pop("m2").close()
    members.wait_for(balanced({"m1", "m3"}, BINDINGS), 5)
    leave_took = time.monotonic() - left

    crashed_at = time.monotonic()
    crash(members.running.pop("m3"))
    members.wait_for(lambda s: s == {"m1": BINDINGS}, TTL + 5)
    crash_took = time.monotonic() - crashed_at

    assert members.policy.preemptions == []
    for binding in members.bindings:
        written = [r.entry.epoch for r in members.reader.store.audit(binding)  # type: ignore[attr-defined]
                   if r.entry.outcome in (Outcome.ACQUIRED, Outcome.TAKEN_OVER)]
        assert written == list(range(1, len(written) + 1))
    print(f"joins {joins_took:.2f} s, leave {leave_took:.2f} s, crash {crash_took:.2f} s")
    assert threading.active_count() < 50
