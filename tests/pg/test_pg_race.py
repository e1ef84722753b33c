"""Real concurrency: OS processes racing acquire and takeover on shared identities.

Eight processes (spawned, each with its own store and connection) meet at a barrier every
round and race for one of three identities: acquire if it has no row yet, else takeover at
the epoch they just read. Around each attempt every process validates the grant it holds for
that identity, so validations race with takeovers. The checker then requires, from the
recorded history and the database:

* exactly one winner per (identity, epoch);
* the audit log's successful acquire/takeover epochs per identity are 1..n, each once, and
  exactly the epochs won;
* no validation accepted a grant of epoch e if it started (by the database clock) after the
  takeover to e + 1 had committed.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from datetime import datetime
from typing import Any

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.grants import ExecutionGrant
from mos_lease.vocabulary import Outcome
from mos_lease_pg import PostgresLeaseStore
from tests.helpers import claim
from tests.pg_support import gather

pytestmark = [pytest.mark.pg, pytest.mark.faults]

PROCESSES = 8
ROUNDS = 100
BINDINGS = 3
SCOPES = ["tool:run"]

# (kind, binding, epoch, accepted, database time): "win" times are read after the winning
# write returned (so after its commit), "validate" times before the validation started.
Event = tuple[str, int, int, bool, datetime]


def race_worker(worker: int, dsn: str, tenant: str, barrier: Any, results: Any) -> None:
    events: list[Event] = []
    error = None
    try:
        with PostgresLeaseStore(dsn) as store:
            gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
            identities = [LeaseIdentity(tenant, "agent", f"b{i}") for i in range(BINDINGS)]
            grants: dict[int, ExecutionGrant] = {}

            def validate(binding: int) -> None:
                grant = grants.get(binding)
                if grant is not None:
                    started = store.now()
                    accepted = gateway.validate(grant, identity=identities[binding],
                                                scopes=SCOPES).ok
                    events.append(("validate", binding, grant.epoch, accepted, started))

            for round_no in range(ROUNDS):
                binding = round_no % BINDINGS
                identity = identities[binding]
                barrier.wait(timeout=60)
                validate(binding)
                result = claim(gateway, identity, f"w{worker}", store.load(identity).row,
                               scopes=SCOPES, ttl=120)
                if result.lease is not None:
                    events.append(("win", binding, result.lease.epoch, True, store.now()))
                    granted = gateway.issue_grant(result.lease, scopes=SCOPES, ttl=30)
                    if granted.grant is not None:
                        grants[binding] = granted.grant
                validate(binding)
    except BaseException as exc:  # report everything: the parent asserts on it
        error = repr(exc)
        barrier.abort()
    results.put((worker, events, error))


def test_processes_racing_for_leases(pg_dsn: str, pg_tenant: str) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    workers = [context.Process(target=race_worker,
                               args=(n, pg_dsn, pg_tenant, barrier, results))
               for n in range(PROCESSES)]
    try:
        reports = gather(workers, results, 120)
    except TimeoutError as late:
        pytest.fail(str(late))
    errors = [error for _, _, error in reports if error is not None]
    assert not errors, errors

    events = [event for _, worker_events, _ in reports for event in worker_events]
    wins = Counter((binding, epoch) for kind, binding, epoch, _, _ in events if kind == "win")
    assert wins and max(wins.values()) == 1, "two winners for one epoch"
    won_at = {(binding, epoch): at for kind, binding, epoch, _, at in events if kind == "win"}

    with PostgresLeaseStore(pg_dsn) as store:
        for binding in range(BINDINGS):
            identity = LeaseIdentity(pg_tenant, "agent", f"b{binding}")
            taken = [r.entry.epoch for r in store.audit(identity, limit=100_000)
                     if r.entry.outcome in (Outcome.ACQUIRED, Outcome.TAKEN_OVER)]
            assert taken == list(range(1, len(taken) + 1)), f"b{binding}: epochs {taken}"
            assert set(taken) == {e for b, e in wins if b == binding}
            row = store.load(identity).row
            assert row is not None and row.epoch == len(taken)

    validations = [e for e in events if e[0] == "validate"]
    assert any(accepted for _, _, _, accepted, _ in validations)
    assert not all(accepted for _, _, _, accepted, _ in validations)
    for _, binding, epoch, accepted, started in validations:
        newer = won_at.get((binding, epoch + 1))
        if accepted and newer is not None:
            # Accepted means the validation's read did not see the takeover, so it began
            # before the takeover committed, which was before the winner read ``newer``.
            assert started < newer, (
                f"b{binding}: epoch {epoch} validated at {started}, after epoch "
                f"{epoch + 1} was committed (seen by {newer})")
    # Many rounds produced a takeover race (more than one epoch per identity).
    assert len(wins) > BINDINGS * 5
