"""One gateway as an OS process running one binding as connector ``NAME``, for the hand-off
test and benchmark with real processes: a thread :class:`~mos_lease.supervisor.Supervisor`
over PostgreSQL with notices. Each line it reads on stdin, ``handover TO``, hands the
binding to ``TO`` (``Supervisor.handover``, no drain) and prints ``handed REASON``; it prints
``started EPOCH`` each time the binding starts holding a lease. End of input closes it. Every
log record of WARNING or above goes to stderr.

    python -m tests.handover_member DSN TENANT NAME [TTL]
"""

from __future__ import annotations

import logging
import sys

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.supervisor import BindingStarted, Change, Supervisor
from mos_lease_pg import LeaseNotices, PostgresLeaseStore

BINDING = ("agent-handover", "main")


def main(argv: list[str]) -> int:
    dsn, tenant, name = argv[:3]
    ttl = float(argv[3]) if len(argv) > 3 else 10.0
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"{name} %(levelname)s %(name)s %(message)s")
    identity = LeaseIdentity(tenant, *BINDING)

    def report(change: Change) -> None:
        if isinstance(change, BindingStarted):
            print(f"started {change.lease.epoch}", flush=True)

    with LeaseNotices(dsn) as notices:
        notices.listening.wait(10)
        store = PostgresLeaseStore(dsn)
        supervisor = Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()),
                                notices=notices, on_change=report)
        supervisor.add(identity, name, scopes=["tool:run"], ttl=ttl)
        for line in sys.stdin:
            command, _, to = line.strip().partition(" ")
            if command == "handover":
                result = supervisor.handover(identity, to=to, drain=0)
                print(f"handed {result.reason or 'ok'}", flush=True)
        supervisor.close()
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
