"""Scenario 8: row and table locks held by another session -> denial, never a hang.

Another session holds a lock while a gateway runs every operation:

* ``row``: ``SELECT ... FOR UPDATE`` on the identity's lease row (as a gateway stuck in the
  middle of a write would): writes to that row must wait and give up, reads go on;
* ``leases``: ``LOCK TABLE ... ACCESS EXCLUSIVE`` on the lease table: everything waits;
* ``audit``: the same on the audit log: every audited step waits.

Two store configurations bound the wait: a short ``lock_timeout``, and no lock timeout but a
short ``statement_timeout``. A call that waits must come back within its timeout plus a
margin, as a refusal (``StoreUnavailable``, or a ``store_unavailable`` validation), and
must have changed nothing. A watchdog releases the lock after a hard cap, so a hang shows up
as a measured time, not a stuck test run.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mos_lease import LeaseHandle, LeaseIdentity
from tests.faults.gateway import Gateway
from tests.faults.history import OpRecord, Status, check_history, read_records
from tests.faults.support import Table, audit_rows, final_rows, percentile, run_prefix, scaled

pytestmark = [pytest.mark.faults, pytest.mark.pg]

LOCK_TIMEOUT = 0.2
STATEMENT_TIMEOUT = 0.25
HARD_CAP = 6.0  # the watchdog lets go here: anything this slow is a hang
MARGIN = 1.0  # allowed beyond the configured timeout (several statements, reconnects)

LOCKS: dict[str, str] = {
    "row": "SELECT 1 FROM mos_lease.logical_agent_connector_leases WHERE tenant_id = %s "
           "AND logical_agent_id = %s AND binding_id = %s FOR UPDATE",
    "leases": "LOCK TABLE mos_lease.logical_agent_connector_leases IN ACCESS EXCLUSIVE MODE",
    "audit": "LOCK TABLE mos_lease.connector_lease_audit_log IN ACCESS EXCLUSIVE MODE",
}
CONFIGS: dict[str, dict[str, float]] = {
    f"lock_timeout {LOCK_TIMEOUT:g} s": {"lock_timeout": LOCK_TIMEOUT, "statement_timeout": 5},
    f"statement_timeout {STATEMENT_TIMEOUT:g} s": {"statement_timeout": STATEMENT_TIMEOUT},
}


class Lock:
    """A lock held by a session of its own, released by the test or by the watchdog."""

    def __init__(self, dsn: str, sql: str, params: tuple[str, ...]) -> None:
        self.conn = psycopg.connect(dsn, application_name="faults-locker")
        self.conn.execute("SET lock_timeout = 0")
        self.conn.execute(sql, params if "%s" in sql else None)
        self._released = threading.Lock()
        self.by_watchdog = False
        self._timer = threading.Timer(HARD_CAP, self._watchdog)
        self._timer.start()

    def _watchdog(self) -> None:
        self.by_watchdog = True
        self.release()

    def release(self) -> None:
        with self._released:
            if not self.conn.closed:
                self.conn.rollback()
                self.conn.close()
        self._timer.cancel()


OP_NAMES = ("acquire (free identity)", "acquire (held identity)", "heartbeat", "heartbeat_many",
            "grant issue", "validate", "takeover (preempt)", "release")


def _ops(gw: Gateway, setup: Gateway, identity: LeaseIdentity
         ) -> dict[str, Callable[[], list[OpRecord]]]:
    """Each operation, with its state prepared before any lock is taken."""
    lease = setup_lease(gw, identity)
    granted = gw.issue_grant(lease, ttl=20)
    assert granted is not None and granted.grant is not None
    grant = granted.grant
    fresh = LeaseIdentity(identity.tenant_id, identity.logical_agent_id,
                          identity.binding_id + "-new")

    def last(n: int = 1) -> list[OpRecord]:
        return gw.rec.records[-n:]

    ops: dict[str, Callable[[], list[OpRecord]]] = {
        "acquire (free identity)": lambda: (gw.acquire(fresh, ttl=20), last())[1],
        "acquire (held identity)": lambda: (gw.acquire(identity, ttl=20), last())[1],
        "heartbeat": lambda: (gw.heartbeat(lease, ttl=20), last())[1],
        "heartbeat_many": lambda: gw.heartbeat_many([lease], ttl=20),
        "grant issue": lambda: (gw.issue_grant(lease, ttl=10), last())[1],
        "validate": lambda: (gw.validate(grant), last())[1],
        "takeover (preempt)": lambda: (gw.takeover(identity, ttl=20,
                                                   expected_epoch=lease.epoch), last())[1],
        "release": lambda: (gw.release(lease), last())[1],
    }
    assert tuple(ops) == OP_NAMES
    return ops


def setup_lease(gw: Gateway, identity: LeaseIdentity) -> LeaseHandle:
    result = gw.acquire(identity, ttl=60)
    assert result is not None and result.lease is not None, result
    return result.lease


def test_locks_and_timeouts(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                            figures: Table, tmp_path: Path) -> None:
    repeats = scaled(soak, 1, 5)
    prefix = run_prefix("s8")
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    outcome: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    hangs: list[str] = []
    wrong: list[str] = []
    serial = 0
    for config_name, timeouts in CONFIGS.items():
        bound = min(timeouts.values()) + MARGIN
        gw = Gateway({"dsn": pg_dsn, "process": f"gw{serial}", "connector": "gw",
                      "records": str(tmp_path / f"gw{serial}.jsonl"), **timeouts})
        setup = gw  # the same gateway prepares (before the lock is taken)
        try:
            for _ in range(repeats):
                for lock_name, sql in LOCKS.items():
                    for op_name in OP_NAMES:
                        serial += 1
                        identity = LeaseIdentity(prefix, f"s{serial}", "b")
                        op = _ops(gw, setup, identity)[op_name]
                        lock = Lock(pg_dsn, sql, (identity.tenant_id,
                                                  identity.logical_agent_id,
                                                  identity.binding_id))
                        began = time.monotonic()
                        try:
                            records = op()
                        finally:
                            took = time.monotonic() - began
                            lock.release()
                        key = (config_name, lock_name)
                        statuses = {f"{r.status}" + (f":{r.reason}" if r.reason else "")
                                    for r in records}
                        outcome[(config_name, lock_name, op_name)] |= statuses
                        blocked = any(r.status is Status.ERROR or r.reason ==
                                      "store_unavailable" for r in records)
                        if blocked:
                            times[key].append(took)
                        if took > bound or lock.by_watchdog:
                            hangs.append(f"{config_name}/{lock_name}/{op_name}: {took:.2f} s")
                        if any(r.status is Status.UNKNOWN for r in records):
                            wrong.append(f"{config_name}/{lock_name}/{op_name}: "
                                         f"{[r.detail for r in records]}")
        finally:
            gw.close()

    records = read_records(tmp_path.glob("*.jsonl"))
    violations = check_history(records, audit_rows(admin, prefix),
                               final_rows=final_rows(admin, prefix))
    figures.add("spec. figure", "denial, never a hang; time to deny bounded and reported")
    for config_name, timeouts in CONFIGS.items():
        bound = min(timeouts.values()) + MARGIN
        for lock_name in LOCKS:
            spent = times[(config_name, lock_name)]
            denied_ops = sorted({op for (c, lk, op), st in outcome.items()
                                 if c == config_name and lk == lock_name
                                 and any(x.startswith("error") or "store_unavailable" in x
                                         for x in st)})
            figures.add(f"{config_name}, {lock_name} lock: time to deny p50 / max (s)",
                        f"{percentile(spent, 0.5):.2f} / {max(spent, default=0):.2f} "
                        f"({len(spent)} denials)",
                        f"<= {bound:g}", bool(spent) and max(spent) <= bound)
            figures.notes.append(f"{config_name}, {lock_name} lock denied: "
                                 f"{', '.join(denied_ops) or '-'}")
    figures.add("hangs (past the bound or freed by the watchdog)", len(hangs), "0", not hangs)
    figures.add("outcomes left unknown under a lock", len(wrong), "0", not wrong)
    figures.add("history checker violations (a timed-out call changed nothing)",
                len(violations), "0", not violations)
    figures.notes += hangs[:10] + wrong[:10] + [str(v) for v in violations[:10]]
    assert not figures.failed(), figures.render()
