"""Scenario 19: a transaction pooler in the path -> 0 event ids applied twice, every
reconcile truthful or unknown.

Everything goes through a real PgBouncer in transaction mode (``tests/pgbouncer.py``: two
server sessions shared by every client) with the store built for it
(``ConnectionSettings(session_options=False, prepare=False)``):

1. the store contract (``mos_lease.testing.run_store_contract``), other clients busy;
2. a takeover race: several threads, each with its own store, read and claim one identity
   round after round: one winner per epoch;
3. writes cut at every point: acquire, heartbeat, takeover and release, each with its
   request lost before the server, its reply lost after the commit, and (all but acquire)
   its client side cut while it waits for the lease row, which another session holds
   ``FOR UPDATE`` and releases at once or a little later, while reconcile is deciding. Behind
   the pooler the startup's backend pid names no backend, so reconcile must not end a
   session by it: it waits out the role's transactions, and the database refuses an event id
   applied twice whatever reconcile answers.

Afterwards no event id may be in the audit log twice, and every call's answer must be what
the database holds (its attempt's audit row says what the caller was told) or an unknown
outcome (``CommitOutcomeUnknown``/``StoreUnavailable``), never a wrong one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    CommitOutcomeUnknown,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    LeaseResult,
    StoreUnavailable,
)
from mos_lease.testing import run_store_contract
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from tests.faults.support import Table
from tests.helpers import claim
from tests.pg.test_pg_pgbouncer import busy
from tests.pg_fixtures import PgSchema, PostgresHarness, StoreFactory
from tests.pg_support import FaultProxy, unique_name
from tests.pgbouncer import PgBouncer

pytestmark = [pytest.mark.faults, pytest.mark.pg]

POOLED = ConnectionSettings(session_options=False, prepare=False)
MARKERS = {"acquire": b"ON CONFLICT (tenant_id", "heartbeat": b"SET heartbeat_at",
           "takeover": b"epoch = l.epoch + 1", "release": b"SET released_at"}
OPERATIONS = tuple(MARKERS)
CUTS = ("request", "reply", "waiting, released at once", "waiting, released after 0.3 s")
RACERS = 4


@attrs.define
class Tally:
    trials: int = 0
    truthful: int = 0
    unknown: int = 0
    wrong: list[str] = attrs.field(factory=list)


def _operation(coordinator: ConnectorLeaseCoordinator, identity: LeaseIdentity,
               name: str) -> Callable[[], LeaseResult]:
    """Set ``identity`` up so that ``name`` will succeed; the call doing it."""
    if name == "acquire":
        return lambda: coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
    first = coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
    assert first.lease is not None
    lease = first.lease
    if name == "heartbeat":
        return lambda: coordinator.heartbeat(lease, ttl=60)
    if name == "release":
        return lambda: coordinator.release(lease)
    return lambda: coordinator.takeover(identity, "c2", scopes=["tool:run"], ttl=30,
                                        expected_epoch=1)


def _held_row(dsn: str, identity: LeaseIdentity) -> psycopg.Connection[Any]:
    holder = psycopg.connect(dsn)
    holder.execute("SELECT 1 FROM mos_lease.logical_agent_connector_leases WHERE tenant_id = %s"
                   " AND logical_agent_id = %s AND binding_id = %s FOR UPDATE",
                   (identity.tenant_id, identity.logical_agent_id, identity.binding_id))
    return holder


def _wait_for_lock(admin: psycopg.Connection[Any]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if admin.execute("SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                         " AND wait_event_type = 'Lock'").fetchone() is not None:
            return True
        time.sleep(0.01)
    return False


def _one_cut(name: str, cut: str, proxy: FaultProxy, dsn: str, tenant: str,
             admin: psycopg.Connection[Any], pg_stores: StoreFactory) -> object:
    """Run ``name`` through the proxy while ``cut`` strikes; the call's answer."""
    identity = LeaseIdentity(tenant, "agent", "b1")
    coordinator = ConnectorLeaseCoordinator(pg_stores(proxy.dsn, settings=POOLED),
                                            AllowAllPolicy())
    operation = _operation(coordinator, identity, name)
    out: list[object] = []

    def run() -> None:
        try:
            out.append(operation())
        except Exception as exc:  # the answer under test
            out.append(exc)

    if cut in ("request", "reply"):
        (proxy.cut_request if cut == "request" else proxy.cut_reply_to)(MARKERS[name])
        run()
        return out[0]
    holder = _held_row(dsn, identity)
    try:
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        waited = _wait_for_lock(admin)
        proxy.cut_client()
        if cut.endswith("0.3 s"):
            time.sleep(0.3)
        holder.commit()
    finally:
        holder.close()
    worker.join(timeout=30)
    return out[0] if out and waited else f"no answer (waited for the lock: {waited})"


def _judge(answer: object, tenant: str, admin: psycopg.Connection[Any], tally: Tally,
           what: str) -> None:
    tally.trials += 1
    if isinstance(answer, CommitOutcomeUnknown | StoreUnavailable):
        tally.unknown += 1
        return
    if not isinstance(answer, LeaseResult):
        tally.wrong.append(f"{what}: {answer!r}"[:200])
        return
    rows = admin.execute("SELECT outcome, reason FROM mos_lease.connector_lease_audit_log"
                         " WHERE tenant_id = %s AND correlation_id = %s",
                         (tenant, answer.correlation_id)).fetchall()
    told = (answer.outcome.value, None if answer.reason is None else answer.reason.value)
    if rows == [told]:
        tally.truthful += 1
    else:
        tally.wrong.append(f"{what}: told {told}, the audit log holds {rows}")


def _race(dsn: str, tenant: str, rounds: int) -> tuple[int, int]:
    """The takeover race; (epochs taken, epochs with more than one winner)."""
    identity = LeaseIdentity(tenant, "agent", "raced")
    barrier = threading.Barrier(RACERS)
    wins: Counter[int] = Counter()
    lock = threading.Lock()

    def racer(n: int) -> None:
        with PostgresLeaseStore(dsn, settings=POOLED) as store:
            gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
            for _ in range(rounds):
                barrier.wait(timeout=60)
                result = claim(gateway, identity, f"c{n}", store.load(identity).row,
                               scopes=["tool:run"], ttl=120)
                if result.lease is not None:
                    with lock:
                        wins[result.lease.epoch] += 1

    threads = [threading.Thread(target=racer, args=(n,)) for n in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return len(wins), sum(1 for count in wins.values() if count > 1)


def test_pooler_in_the_path(pgbouncer: PgBouncer, pg_dsn: str, pg_stores: StoreFactory,
                            pg_migrated_schema_dsn: PgSchema, admin: psycopg.Connection[Any],
                            soak: bool, figures: Table) -> None:
    steps, rounds, repeats = (400, 60, 3) if soak else (100, 15, 1)
    schema = pg_migrated_schema_dsn
    settings = schema.settings(session_options=False, prepare=False)
    store = pg_stores(pgbouncer.dsn(schema.dsn), settings=settings)
    with busy([pg_stores(pgbouncer.dsn(schema.dsn), settings=settings) for _ in range(2)]):
        run_store_contract(lambda: PostgresHarness(store), steps=steps)

    race_tenant = unique_name("race")
    epochs, doubled = _race(pgbouncer.dsn(pg_dsn), race_tenant, rounds)

    tally = Tally()
    tenants = []
    proxy = FaultProxy(pgbouncer.dsn(pg_dsn))
    try:
        for _ in range(repeats):
            for name in OPERATIONS:
                for cut in CUTS:
                    if name == "acquire" and cut.startswith("waiting"):
                        continue  # an insert never waits for a row another session holds
                    tenant = unique_name("cut")
                    tenants.append(tenant)
                    answer = _one_cut(name, cut, proxy, pg_dsn, tenant, admin, pg_stores)
                    _judge(answer, tenant, admin, tally, f"{name}, {cut}")
    finally:
        proxy.close()
    twice = admin.execute("SELECT count(*) FROM (SELECT event_id FROM"
                          " mos_lease.connector_lease_audit_log WHERE tenant_id = ANY(%s)"
                          " GROUP BY event_id HAVING count(*) > 1) AS d",
                          ([*tenants, race_tenant],)).fetchone()
    assert twice is not None

    figures.add("store contract steps through PgBouncer", steps, "all pass", True)
    figures.add("takeover race: epochs, with more than one winner",
                f"{epochs} epochs, {doubled}", "0", doubled == 0 and epochs >= rounds)
    figures.add("cut writes (4 operations x request/reply/waiting)", tally.trials)
    figures.add("answers truthful / unknown", f"{tally.truthful} / {tally.unknown}")
    figures.add("answers wrong", len(tally.wrong), "0", not tally.wrong)
    figures.add("event ids applied twice", twice[0], "0", twice[0] == 0)
    figures.notes += tally.wrong
    print(f"\nscenario 19: {steps} contract steps, {epochs} raced epochs ({doubled} doubled), "
          f"{tally.trials} cuts: {tally.truthful} truthful, {tally.unknown} unknown, "
          f"{len(tally.wrong)} wrong; {twice[0]} event ids applied twice")
    assert doubled == 0 and epochs >= rounds
    assert not tally.wrong, tally.wrong
    assert twice[0] == 0
