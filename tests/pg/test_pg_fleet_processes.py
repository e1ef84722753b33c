"""A fleet of real OS processes (``tests/fleet_member.py``) over one PostgreSQL database:
two members share the bindings, a third joins and gets its share by planned hand-offs, one
is stopped with SIGTERM (its bindings are held by the others within a second or so, and no
member logs a WARNING), one is killed with SIGKILL (the last one takes its bindings over
after their expiry). The audit log shows each binding's epochs going up by one, and no
takeover asked of an active lease (the members' policy refuses preemption, and would audit
it as ``preemption_denied``)."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.vocabulary import LeaseState, Outcome, Reason
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["p1", "p2", "p3"]
COUNT, TTL, LOOK, GRACE = 600, 4.0, 0.5, 2.0
# Connecting as a superuser, every store warns about privileges it never uses: not a
# warning of the fleet's.
EXPECTED = "holds privileges it never uses"


class Processes:
    def __init__(self, dsn: str, fleet: str, tenant: str) -> None:
        self.dsn, self.fleet, self.tenant = dsn, fleet, tenant
        self.running: dict[str, subprocess.Popen[str]] = {}
        self.ended: dict[str, tuple[int, str, str]] = {}

    def start(self, name: str) -> None:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet_member", self.dsn, self.fleet, name,
             ",".join(NAMES), self.tenant, str(COUNT), str(TTL), str(LOOK), str(GRACE)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "started"
        self.running[name] = process

    def stop(self, name: str, how: signal.Signals) -> float:
        """Signal ``name`` and wait for it to exit: the signal's monotonic time."""
        process = self.running.pop(name)
        sent = time.monotonic()
        process.send_signal(how)
        out, err = process.communicate(timeout=30)
        self.ended[name] = (process.returncode, out, err)
        return sent

    def close(self) -> None:
        for name in list(self.running):
            self.stop(name, signal.SIGTERM)

    def warnings(self) -> list[str]:
        return [line for _, _, err in self.ended.values() for line in err.splitlines()
                if line.strip() and EXPECTED not in line]


@pytest.fixture
def fleet(pg_dsn: str, pg_tenant: str) -> Iterator[Processes]:
    processes = Processes(pg_dsn, pg_tenant, pg_tenant)
    try:
        yield processes
    finally:
        processes.close()


def test_real_processes_join_stop_and_crash(fleet: Processes, pg_stores: StoreFactory,
                                            pg_tenant: str) -> None:
    reader = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    bindings = [LeaseIdentity(pg_tenant, f"agent-{n}", "main") for n in range(COUNT)]

    def shares() -> Counter[str | None]:
        return Counter(None if v is None or v.state is not LeaseState.ACTIVE
                       else v.connector_id for v in reader.current_holders(bindings))

    def wait_for(check: Callable[[Counter[str | None]], bool], timeout: float,
                 start: float | None = None) -> float:
        start = time.monotonic() if start is None else start
        while not check(found := shares()):
            assert time.monotonic() - start < timeout, f"timed out: {found}"
            time.sleep(0.05)
        return time.monotonic() - start

    def balanced(names: set[str]) -> Callable[[Counter[str | None]], bool]:
        cap = math.ceil(1.1 * COUNT / len(names))
        return lambda s: set(s) == names and max(s.values()) <= cap

    fleet.start("p1")
    fleet.start("p2")
    wait_for(balanced({"p1", "p2"}), 30)
    fleet.start("p3")
    joined = wait_for(balanced(set(NAMES)), 15)
    left = wait_for(balanced({"p1", "p3"}), 10, fleet.stop("p2", signal.SIGTERM))
    assert fleet.ended["p2"][0] == 0
    assert fleet.warnings() == []
    crashed = wait_for(lambda s: s == {"p1": COUNT}, TTL + 10,
                       fleet.stop("p3", signal.SIGKILL))
    for binding in bindings:
        audit = reader.store.audit(binding)  # type: ignore[attr-defined]
        written = [r.entry.epoch for r in audit
                   if r.entry.outcome in (Outcome.ACQUIRED, Outcome.TAKEN_OVER)]
        assert written == list(range(1, len(written) + 1))
        assert not [r for r in audit if r.entry.reason is Reason.PREEMPTION_DENIED]
    print(f"join {joined:.2f} s, SIGTERM {left:.2f} s, SIGKILL {crashed:.2f} s")
    fleet.close()
    assert fleet.ended["p1"][0] == 0
    assert fleet.warnings() == []
