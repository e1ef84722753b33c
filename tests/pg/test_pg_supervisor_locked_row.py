"""The supervisor on PostgreSQL while a long tool holds one binding's lease row.

A ``fenced_transaction(..., valid_until=ValidUntil.LEASE)`` that stays open keeps its lease
row ``FOR SHARE``. Every binding of the supervisor is renewed in one batch; the batch must
renew all the others on every tick, never wait for that row, and report none of them lost.
The held lease is retried as after a transient failure: renewed once the lock goes, or lost
at its own deadline if the lock outlives it.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity, LossCause, Reason
from mos_lease.supervisor import BindingLost, BindingStarted, Change, Supervisor
from mos_lease_pg import ConnectionSettings, sql_files
from tests.pg.test_pg_supervisor import FakeTime, _run, _settle
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ("tool:run",)
TTL = 30.0  # renewed every 10 s; deadline 30 - (3 + 2) = 25 s after a renewal's start
N = 60
TICK = TTL / 3 + 0.5

# What a fenced_transaction takes on its lease row (the tables live in the library's
# schema, named explicitly).
SHARE_ROW = sql.SQL("SELECT 1 FROM {}.logical_agent_connector_leases WHERE tenant_id = %s "
                    "AND logical_agent_id = %s AND binding_id = %s FOR SHARE").format(
                        sql.Identifier(sql_files.DEFAULT_SCHEMA))


def _expiries(store: Any, identities: list[LeaseIdentity]) -> dict[LeaseIdentity, datetime]:
    expiries = {}
    for identity in identities:
        row = store.load(identity).row
        assert row is not None
        expiries[identity] = row.expires_at
    return expiries


def test_a_row_held_across_renewal_ticks_costs_the_other_bindings_nothing(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    # A short lock_timeout only bounds how long a batch that did wait would take to fail;
    # a batch that skips the held row never meets it.
    inner = pg_stores(settings=ConnectionSettings(lock_timeout=timedelta(seconds=0.5)))
    clock = FakeTime(inner)
    coordinator = ConnectorLeaseCoordinator(inner, AllowAllPolicy(), monotonic_clock=clock)
    changes: list[Change] = []
    sleeps: list[float] = []
    supervisor = Supervisor(coordinator, on_change=changes.append, clock=clock,
                            sleep=sleeps.append, random=lambda: 0.5, background=False)
    identities = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(N)]
    for identity in identities:
        supervisor.add(identity, "gw-a", scopes=SCOPES, ttl=TTL)
    _settle(supervisor, sleeps)
    assert sum(isinstance(c, BindingStarted) for c in changes) == N
    held = identities[17]
    others = [identity for identity in identities if identity != held]
    key = (held.tenant_id, held.logical_agent_id, held.binding_id)

    def lost() -> list[tuple[LeaseIdentity, LossCause]]:
        return [(c.identity, c.loss.cause) for c in changes if isinstance(c, BindingLost)]

    # 1. The tool holds the row for two renewal ticks (21 s: inside the 25 s deadline).
    with psycopg.connect(pg_dsn) as tool:
        tool.execute(SHARE_ROW, key)
        first = _expiries(inner, [held])[held]
        for tick in range(2):
            before = _expiries(inner, others)
            began = time.monotonic()
            _run(supervisor, sleeps, clock, TICK)
            after = _expiries(inner, others)
            assert all(after[i] > before[i] for i in others), f"tick {tick}: not renewed"
            assert lost() == [], f"tick {tick}"
            assert all(supervisor.lease(i) is not None for i in identities)
            # No batch waited for the lock (each would have taken lock_timeout, 0.5 s).
            assert time.monotonic() - began < 10, f"tick {tick}"
        assert _expiries(inner, [held])[held] == first  # the held lease was never written
        tool.commit()
    # The lock is gone: the retry renews the held lease before its deadline.
    _run(supervisor, sleeps, clock, 3)
    assert _expiries(inner, [held])[held] > first
    assert lost() == []
    assert all(supervisor.lease(i) is not None for i in identities)

    # 2. The tool holds the row past the held lease's deadline: that lease alone is lost,
    # at its own deadline, as after any transient failure; every other is still renewed.
    with psycopg.connect(pg_dsn) as tool:
        tool.execute(SHARE_ROW, key)
        for tick in range(3):
            before = _expiries(inner, others)
            _run(supervisor, sleeps, clock, TICK)
            after = _expiries(inner, others)
            assert all(after[i] > before[i] for i in others), f"tick {tick}: not renewed"
        tool.commit()
    assert lost() == [(held, LossCause.DEADLINE)]
    (loss,) = [c.loss for c in changes if isinstance(c, BindingLost)]
    assert loss.reason is Reason.LEASE_EXPIRED
    state = supervisor._core.schedule.slots[held].state
    assert state is not None and 0 <= loss.at - state.deadline < 1.0  # at its deadline
    assert loss.error is not None and "store_unavailable" in loss.error
    assert all(supervisor.lease(i) is not None for i in others)
    supervisor.close()
