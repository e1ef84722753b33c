"""Scenario 7: gateway clocks skewed by +-10 minutes, at 0.5x and 2x -> 0 decisions off.

Each gateway process runs with every clock it can read (wall, monotonic, boottime,
``datetime.now`` inside the library) moved by an offset and running at a rate (see
``clockskew.py``), next to a control process with true clocks. Each works alone on its own
identities with a policy that never preempts, so every decision depends only on database
time. The oracle replays each identity's history against the database clock readings taken
around every call: where the call lies wholly on one side of an expiry the expected decision
is determined, and it, and every expiry the library reports, must match.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.faults.history import Ident, Op, OpRecord, Status, check_history, read_records
from tests.faults.support import (
    Table,
    Worker,
    audit_rows,
    final_rows,
    run_prefix,
    scaled,
    workers_cleanup,
)

pytestmark = [pytest.mark.faults, pytest.mark.pg]

CLOCKS = [(0.0, 1.0), (600.0, 0.5), (600.0, 2.0), (-600.0, 0.5), (-600.0, 2.0)]
TTL = 1.0
GRANT_TTL = 0.6
SLACK = timedelta(milliseconds=2)  # timestamps round-trip at microsecond precision
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _Lease:
    epoch: int = 0
    lease_id: str | None = None
    expires: datetime | None = None
    released: bool = False


Expected = tuple[Status, str | None] | None  # None: the call straddles an expiry


def _holder(state: _Lease, epoch: int | None, lease_id: object, s: datetime,
            e: datetime) -> Expected:
    """The decision for a call presenting (epoch, lease id) over database time [s, e]."""
    if state.epoch == 0 or state.expires is None:
        return Status.DENIED, "lease_missing"
    if epoch is None or epoch < state.epoch:
        return Status.DENIED, "stale_epoch"
    if epoch > state.epoch:
        return Status.DENIED, "epoch_mismatch"
    if lease_id != state.lease_id:
        return Status.DENIED, "lease_replaced"
    if state.released:
        return Status.DENIED, "lease_released"
    if state.expires <= s:
        return Status.DENIED, "lease_expired"
    if state.expires > e:
        return Status.OK, None
    return None


def _expected(r: OpRecord, state: _Lease, grant_expiry: dict[str, datetime]) -> Expected:
    s, e = r.start, r.end
    assert e is not None
    over_all = state.released or (state.expires is not None and state.expires <= s)
    active_all = not state.released and state.expires is not None and state.expires > e
    if r.op is Op.ACQUIRE:
        if state.epoch == 0:
            return Status.OK, None
        if active_all:
            return Status.DENIED, "lease_held"
        return (Status.DENIED, "takeover_required") if over_all else None
    if r.op is Op.TAKEOVER:
        if state.epoch == 0:
            return Status.DENIED, "lease_missing"
        if r.args.get("expected_epoch") != state.epoch:
            return Status.DENIED, "epoch_mismatch"
        if over_all:
            return Status.OK, None
        return (Status.DENIED, "preemption_denied") if active_all else None
    if r.op is Op.VALIDATE:
        expiry = grant_expiry.get(str(r.args.get("grant_id")))
        if expiry is None:
            return None
        if expiry <= s:
            return Status.DENIED, "grant_expired"
        holder = _holder(state, r.args.get("epoch"), r.args.get("lease_id"), s, e)
        if expiry > e:
            return holder
        return None
    return _holder(state, r.args.get("epoch"), r.args.get("lease_id"), s, e)


def _check_times(r: OpRecord, state: _Lease, grant_expiry: dict[str, datetime]) -> str | None:
    """Every expiry the library reported must be database time + TTL (a gateway clock
    10 minutes off would be plain to see here)."""
    s, e = r.start, r.end
    assert e is not None and r.expires_at is not None
    got = r.expires_at
    if r.op in (Op.ACQUIRE, Op.TAKEOVER, Op.HEARTBEAT):
        low, high = s + timedelta(seconds=TTL), e + timedelta(seconds=TTL)
        if not low - SLACK <= got <= high + SLACK:
            return f"expiry {got} outside [{low}, {high}]"
    elif r.op is Op.ISSUE_GRANT:
        assert state.expires is not None
        high = min(e + timedelta(seconds=GRANT_TTL), state.expires)
        low = min(s + timedelta(seconds=GRANT_TTL), state.expires)
        if not low - SLACK <= got <= high + SLACK:
            return f"grant expiry {got} outside [{low}, {high}]"
    elif r.op is Op.VALIDATE:
        expiry = grant_expiry.get(str(r.args.get("grant_id")))
        assert state.expires is not None
        if expiry is not None and got != min(expiry, state.expires):
            return f"context expiry {got} != min(grant {expiry}, lease {state.expires})"
    return None


def judge(records: list[OpRecord]) -> tuple[int, int, int, list[str]]:
    """(calls, determinate, ambiguous, differences) against the database-time oracle."""
    by_identity: dict[Ident, list[OpRecord]] = {}
    for r in records:
        by_identity.setdefault(r.identity, []).append(r)
    calls = determinate = ambiguous = 0
    differences: list[str] = []
    for ops in by_identity.values():
        state = _Lease()
        grant_expiry: dict[str, datetime] = {}
        for r in sorted(ops, key=lambda x: (x.process, x.n)):
            calls += 1
            if r.status not in (Status.OK, Status.DENIED):
                differences.append(f"{r.process}#{r.n} {r.op}: {r.status} {r.detail[:80]}")
                continue
            expected = _expected(r, state, grant_expiry)
            if expected is None:
                ambiguous += 1
            else:
                determinate += 1
                if (r.status, r.reason) != expected:
                    differences.append(f"{r.process}#{r.n} {r.op} [{r.start}, {r.end}]: got "
                                       f"{r.status}/{r.reason}, database time says "
                                       f"{expected[0]}/{expected[1]}")
            if r.status is Status.OK:
                problem = _check_times(r, state, grant_expiry)
                if problem is not None:
                    differences.append(f"{r.process}#{r.n} {r.op}: {problem}")
                if r.op in (Op.ACQUIRE, Op.TAKEOVER):
                    state = _Lease(r.epoch or 0, r.lease_id, r.expires_at, False)
                elif r.op is Op.HEARTBEAT:
                    state.expires = r.expires_at
                elif r.op is Op.RELEASE:
                    state.released = True
                elif r.op is Op.ISSUE_GRANT and r.grant_id and r.expires_at:
                    grant_expiry[r.grant_id] = r.expires_at
    return calls, determinate, ambiguous, differences


def test_clock_skew(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool, figures: Table,
                    tmp_path: Path) -> None:
    duration = scaled(soak, 4, 30)
    prefix = run_prefix("s7")
    with workers_cleanup() as made:
        for i, (offset, rate) in enumerate(CLOCKS):
            made.append(Worker("skew", {
                "dsn": pg_dsn, "process": f"skew{i}", "connector": f"skew{i}",
                "tenant": prefix, "bindings": [f"g{i}-b0", f"g{i}-b1"], "ttl": TTL,
                "grant_ttl": GRANT_TTL, "offset": offset, "rate": rate, "seed": 70 + i,
                "records": str(tmp_path / f"skew{i}.jsonl"), "max_seconds": duration,
            }, tmp_path, skew=None if (offset, rate) == (0.0, 1.0) else (offset, rate)))
        for worker in made:
            worker.wait_for("READY", 60)
        summaries = [worker.finish(duration + 60) for worker in made]

    records = read_records(tmp_path.glob("skew*.jsonl"))
    violations = check_history(records, audit_rows(admin, prefix),
                               final_rows=final_rows(admin, prefix))
    figures.add("spec. figure / this run", f"+-10 min at 0.5x and 2x / {len(CLOCKS) - 1} skewed "
                f"gateways + 1 control, {duration} s each")
    total_diff = 0
    for i, (offset, rate) in enumerate(CLOCKS):
        mine = [r for r in records if r.process == f"skew{i}"]
        calls, determinate, ambiguous, differences = judge(mine)
        total_diff += len(differences)
        seen = summaries[i]["observed"]
        label = "control (true clocks)" if (offset, rate) == (0, 1) else \
            f"offset {offset:+.0f} s, rate {rate}x"
        figures.add(f"{label}: clocks seen by the gateway",
                    f"time {seen['time_offset']:+.1f} s, datetime "
                    f"{seen['datetime_offset']:+.1f} s, rate "
                    f"{float(summaries[i]['rate_observed']):.2f}x",
                    "as configured",
                    abs(seen["time_offset"] - offset) < 5
                    and abs(seen["datetime_offset"] - offset) < 5
                    and abs(float(summaries[i]["rate_observed"]) - rate) < 0.1 * rate)
        outcomes = Counter(f"{r.op}:{r.reason or 'ok'}" for r in mine)
        figures.add(f"{label}: calls / judged / straddling an expiry",
                    f"{calls} / {determinate} / {ambiguous}", "judged > 0", determinate > 0)
        figures.add(f"{label}: decisions differing from database time", len(differences), "0",
                    not differences)
        figures.notes.append(f"{label}: " + ", ".join(
            f"{k}={v}" for k, v in sorted(outcomes.items())))
        figures.notes += differences[:5]
    figures.add("decisions differing from the database-time oracle (all)", total_diff, "0",
                total_diff == 0)
    figures.add("history checker violations", len(violations), "0", not violations)
    figures.notes += [str(v) for v in violations[:10]]
    assert not figures.failed(), figures.render()


def test_a_fast_clocks_offset_is_judged_as_of_its_install() -> None:
    """At 2x a skewed clock gains a second per real second: the offset a worker reports is
    taken back to the install, so that a slow start on a loaded machine does not read as a
    wrong offset."""
    script = ("import time; from tests.faults import clockskew; clockskew.install(600.0, 2.0); "
              "time.sleep(1.5); raw = time.time() - clockskew.real_wall(); "
              "print(raw, raw - clockskew.gained())")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60)
    raw, as_installed = (float(x) for x in done.stdout.split())
    assert raw > 601.4, raw  # the gain is real (1.5 s of sleep, and more under load)
    assert abs(as_installed - 600.0) < 0.05, as_installed
