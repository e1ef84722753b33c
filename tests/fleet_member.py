"""One fleet member as an OS process, for the fleet tests and benchmark with real processes:
a thread :class:`~mos_lease.supervisor.Supervisor` over PostgreSQL with notices, joined to a
fleet, running ``count`` bindings of ``tenant``. The policy allows everything but
preemption. SIGTERM closes it (its leases released, the others take them over) and it exits
0; SIGKILL is a crash; SIGUSR1 prints the member's round trips, renewal ticks and held
leases as a JSON line. It runs with the recipes' garbage-collector thresholds
(:data:`examples.recipes.command.GC_THRESHOLDS`), as a gateway of this size should. Every
log record of WARNING or above goes to stderr, so a caller can show that none was logged.

    python -m tests.fleet_member DSN FLEET NAME MEMBERS(comma-separated) TENANT COUNT \
        [TTL LOOK GRACE]
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from datetime import timedelta

from examples.recipes.command import tune_gc
from mos_lease import ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.fleet import Fleet
from mos_lease.policy import ConnectorRule, StaticConnectorPolicy
from mos_lease.supervisor import Supervisor
from mos_lease_pg import LeaseNotices, PostgresLeaseStore

# Everything allowed but taking over an active lease: a preemption the fleet asked for would
# be refused and audited with the reason ``preemption_denied``, for the tests to find.
NO_PREEMPTION = StaticConnectorPolicy([ConnectorRule(
    "*", "*", "*", "*", ("tool:run",), timedelta(minutes=5), timedelta(seconds=30),
    preempt_active=False)])


def main(argv: list[str]) -> int:
    dsn, fleet, name, members, tenant, count = argv[:6]
    ttl, look, grace = (float(v) for v in (argv[6:9] or ("10", "1", "5")))
    tune_gc()  # as the recipes' gateways do
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"{name} %(levelname)s %(name)s %(message)s")
    stop = threading.Event()
    asked = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: asked.set())
    with LeaseNotices(dsn) as notices:
        notices.listening.wait(10)
        store = PostgresLeaseStore(dsn)
        supervisor = Supervisor(
            ConnectorLeaseCoordinator(store, NO_PREEMPTION), notices=notices,
            fleet=Fleet(fleet, name, members=members.split(","), ttl=ttl, look=look,
                        grace=grace, endpoint=f"{name}.internal:8443"))
        for n in range(int(count)):
            supervisor.add(LeaseIdentity(tenant, f"agent-{n}", "main"), name,
                           scopes=["tool:run"], ttl=ttl)
        print("started", flush=True)
        while not stop.wait(0.05):
            if asked.is_set():  # SIGUSR1: what this member sent so far, as one JSON line
                asked.clear()
                stats = supervisor.stats()
                print(json.dumps({"round_trips": sum(store.stats().round_trips.values()),
                                  "renewal_ticks": stats.renewal_ticks,
                                  "held": stats.bindings_held}), flush=True)
        supervisor.close()
        store.close()
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
