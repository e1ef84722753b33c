"""Scenario 3: holder frozen by SIGSTOP past its lease, a rival takes over, it resumes: 0 accepted.

The holder keeps heartbeating, minting and validating with what it had; none of it may be
accepted once the rival's takeover has committed.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mos_lease import LeaseIdentity
from tests.faults.gateway import Gateway
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

# "expired": the rival waits until the frozen holder's lease has expired by database time
# (the specified case). "preempted": the rival preempts while the holder's lease and grants are
# still unexpired, so only the epoch fences the holder when it wakes up.
MODES = ("expired", "preempted")
TTL = {"expired": 1.0, "preempted": 20.0}
RESUME_FOR = 1.0


def _wait_expired(rival: Gateway, identity: LeaseIdentity, patience: float) -> int:
    """Poll the row until its lease is over by database time; returns its epoch."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        snapshot = rival.store.load(identity)
        assert snapshot.row is not None
        if snapshot.row.expires_at <= snapshot.now:
            return snapshot.row.epoch
        time.sleep(min(0.1, (snapshot.row.expires_at - snapshot.now).total_seconds() + 0.01))
    raise AssertionError(f"{identity}: lease did not expire within {patience} s")


def _wave(pg_dsn: str, tmp_path: Path, prefix: str, wave: int, per_wave: int,
          rival: Gateway, takeover_end: dict[Ident, Any]) -> int:
    """Start holders, freeze them, take their leases over, thaw them; returns trials."""
    with workers_cleanup() as made:
        plan: list[tuple[Worker, LeaseIdentity, str]] = []
        for k in range(per_wave):
            mode = MODES[k % 2]
            identity = LeaseIdentity(prefix, "agent", f"w{wave}-h{k}")
            worker = Worker("holder", {
                "dsn": pg_dsn, "process": f"holder{wave}-{k}", "tenant": prefix,
                "bindings": [identity.binding_id], "ttl": TTL[mode],
                "stop_file": str(tmp_path / f"stop{wave}"),
                "records": str(tmp_path / f"holder{wave}-{k}.jsonl"), "max_seconds": 60,
            }, tmp_path)
            made.append(worker)
            plan.append((worker, identity, mode))
        for worker, _, _ in plan:
            worker.wait_for("READY", 60)
        time.sleep(0.3)  # let them heartbeat, mint and validate for a while
        for worker, _, _ in plan:
            worker.signal(signal.SIGSTOP)
        for _worker, identity, mode in plan:
            if mode == "expired":
                epoch = _wait_expired(rival, identity, TTL[mode] + 10)
            else:
                snapshot = rival.store.load(identity)
                assert snapshot.row is not None
                assert snapshot.row.expires_at > snapshot.now  # still active
                epoch = snapshot.row.epoch
            result = rival.takeover(identity, ttl=30, expected_epoch=epoch)
            assert result is not None and result.ok, result
            takeover_end[(identity.tenant_id, identity.logical_agent_id,
                          identity.binding_id)] = rival.rec.records[-1].end
        for worker, _, _ in plan:
            worker.signal(signal.SIGCONT)
        time.sleep(RESUME_FOR)  # the holders keep trying with what they have
        (tmp_path / f"stop{wave}").touch()
        for worker, _, _ in plan:
            summary = worker.finish(60)
            assert not summary["crashes"], summary
        return len(plan)


def test_sigstop_holder(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                        figures: Table, tmp_path: Path) -> None:
    waves = scaled(soak, 1, 4)
    per_wave = 4
    prefix = run_prefix("s3")
    rival = Gateway({"dsn": pg_dsn, "process": "rival", "connector": "rival",
                     "records": str(tmp_path / "rival.jsonl")})
    takeover_end: dict[Ident, Any] = {}
    trials = 0
    try:
        for wave in range(waves):
            trials += _wave(pg_dsn, tmp_path, prefix, wave, per_wave, rival, takeover_end)
    finally:
        rival.close()

    records = read_records(tmp_path.glob("*.jsonl"))
    audit = audit_rows(admin, prefix)
    violations = check_history(records, audit, final_rows=final_rows(admin, prefix))

    def after_takeover(r: OpRecord) -> bool:
        end = takeover_end.get(r.identity)
        return r.process.startswith("holder") and end is not None and r.start > end

    late = [r for r in records if after_takeover(r)]
    late_ops = Counter(r.op for r in late)
    accepted = [r for r in late if r.status is Status.OK]
    reasons = Counter(r.reason for r in late if r.status is Status.DENIED)
    by_mode = Counter(mode for mode in MODES for _ in range(waves * per_wave // 2))

    figures.add("spec. figure / this run", f"SIGSTOP past lease, rival takeover, resume / "
                f"{trials} holders ({by_mode['expired']} expired, {by_mode['preempted']} "
                f"preempted while frozen)")
    figures.counts("trials", waves * per_wave, trials)
    figures.add("holder calls after the rival's takeover",
                ", ".join(f"{op}={late_ops[op]}" for op in (Op.HEARTBEAT, Op.ISSUE_GRANT,
                                                             Op.VALIDATE)),
                f">= {10 * trials} (kept trying)", len(late) >= 10 * trials)
    figures.add("of them accepted (heartbeats, grants, validations)", len(accepted), "0",
                not accepted)
    figures.add("refusal reasons", dict(reasons.most_common()))
    figures.add("history checker violations", len(violations), "0", not violations)
    for v in violations[:10]:
        figures.notes.append(str(v))
    assert not figures.failed(), figures.render()
