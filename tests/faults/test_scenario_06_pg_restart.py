"""Scenario 6: PostgreSQL stopped and restarted under load, 10 cycles -> nothing lost.

The server here is a private throwaway cluster (never the shared one). Worker processes keep
heartbeating, minting, validating, releasing and taking over while it is stopped (``fast``
and ``immediate`` shutdowns alternate) and started again. While it is down no validation may
be allowed; every change a worker was told had committed must be in the database afterwards;
and the same worker processes, with the same store objects, must work again once it is back.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mos_lease_pg.admin import migrate
from tests.faults.history import (
    AuditRow,
    FinalRow,
    Op,
    OpRecord,
    Status,
    check_history,
    read_records,
)
from tests.faults.support import (
    PrivateCluster,
    Table,
    Worker,
    audit_rows,
    create_db,
    final_rows,
    percentile,
    run_prefix,
    scaled,
    workers_cleanup,
)

pytestmark = [pytest.mark.faults, pytest.mark.pg]

WORKERS = 3
# Up windows outlast the workers' connect_timeout (2 s): a connect attempt that reached the
# listen backlog while the server was shutting down waits that long before it fails, and a
# worker caught in one must still get a chance to succeed before the next stop.
LOAD_S = 2.5
DOWN_S = 0.7


@dataclass
class Run:
    windows: list[tuple[float, float]]  # (down from, down until) on the host clock
    starts: list[float]  # when each restart had completed
    summaries: list[dict[str, Any]]
    audit: list[AuditRow]
    finals: list[FinalRow]


def _run(tmp_path: Path, prefix: str, cycles: int) -> Run:
    """Workers on a private cluster that is stopped and started ``cycles`` times."""
    cluster = PrivateCluster()
    run = Run([], [], [], [], [])
    try:
        cluster.start()
        dsn = create_db(cluster.dsn, "faults")
        migrate(dsn)
        with workers_cleanup() as made:
            for w in range(WORKERS):
                made.append(Worker("load", {
                    "dsn": dsn, "process": f"load{w}", "connector": f"load{w}",
                    "tenant": prefix, "bindings": [f"w{w}-b0", f"w{w}-b1"], "ttl": 60,
                    "seed": w, "stop_file": str(tmp_path / "stop"),
                    "records": str(tmp_path / f"load{w}.jsonl"), "max_seconds": 300,
                    "connect_timeout": 2, "statement_timeout": 3, "lock_timeout": 2,
                }, tmp_path))
            for worker in made:
                worker.wait_for("READY", 60)
            for cycle in range(cycles):
                time.sleep(LOAD_S)
                cluster.stop("immediate" if cycle % 2 else "fast")
                down_from = time.monotonic()  # pg_ctl -w returned: the server is gone
                time.sleep(DOWN_S)
                run.windows.append((down_from, time.monotonic()))
                cluster.start()
                run.starts.append(time.monotonic())
            time.sleep(LOAD_S * 2)
            (tmp_path / "stop").touch()
            run.summaries = [worker.finish(120) for worker in made]
        with psycopg.connect(dsn, autocommit=True) as admin:
            run.audit = audit_rows(admin, prefix)
            run.finals = final_rows(admin, prefix)
    finally:
        cluster.close()
    return run


def _recovery(records: list[OpRecord], run: Run) -> tuple[list[float], int]:
    """Per restart and worker: seconds from "server started" to its first success; and how
    many worker x restart pairs had none before the next stop."""
    recovery: list[float] = []
    unrecovered = 0
    for i, started in enumerate(run.starts):
        until = run.windows[i + 1][0] if i + 1 < len(run.windows) else float("inf")
        for w in range(WORKERS):
            firsts = [float(r.args["m0"]) for r in records
                      if r.process == f"load{w}" and r.status is Status.OK
                      and started <= float(r.args["m0"]) < until]
            if firsts:
                recovery.append(max(0.0, min(firsts) - started))
            else:
                unrecovered += 1
    return recovery, unrecovered


def test_pg_stop_restart(soak: bool, figures: Table, tmp_path: Path) -> None:
    cycles = scaled(soak, 3, 10)
    prefix = run_prefix("s6")
    run = _run(tmp_path, prefix, cycles)
    windows, starts, summaries = run.windows, run.starts, run.summaries
    audit, finals = run.audit, run.finals

    records = read_records(tmp_path.glob("*.jsonl"))
    violations = check_history(records, audit, final_rows=finals)

    def inside_down(r: OpRecord) -> bool:
        m0, m1 = float(r.args["m0"]), float(r.args["m1"])
        return any(lo <= m0 and m1 <= hi for lo, hi in windows)

    down_validations = [r for r in records if r.op is Op.VALIDATE and inside_down(r)]
    allowed_down = [r for r in down_validations if r.status is Status.OK]
    down_ops = [r for r in records if inside_down(r)]
    down_ok = [r for r in down_ops if r.status is Status.OK]
    acknowledged = [r for r in records if r.status is Status.OK and r.op is not Op.VALIDATE]
    lost = [v for v in violations if v.kind.value in ("audit_missing", "final_state")]
    recovery, unrecovered = _recovery(records, run)
    statuses = Counter(f"{r.status}" for r in down_ops)
    crashes = sum(len(s["crashes"]) for s in summaries)

    figures.add("spec. figure / this run", f"10 cycles / {cycles} cycles (fast and immediate "
                f"shutdowns alternate), {WORKERS} worker processes")
    figures.counts("stop/start cycles", cycles, len(starts))
    figures.add("calls made entirely while down", dict(statuses.most_common()),
                "> 0", len(down_ops) > 0)
    figures.add("validations while down: attempted / allowed",
                f"{len(down_validations)} / {len(allowed_down)}", "allowed = 0",
                not allowed_down and len(down_validations) > 0)
    figures.add("any call succeeding while down", len(down_ok), "0", not down_ok)
    figures.add("acknowledged changes", len(acknowledged))
    figures.add("acknowledged changes lost", len(lost), "0", not lost)
    figures.add("recovery after start, p50 / max (s)",
                f"{percentile(recovery, 0.5):.2f} / {max(recovery, default=float('nan')):.2f}",
                "< 5", bool(recovery) and max(recovery) < 5)
    figures.add("worker x restart with no success before the next stop", unrecovered, "0",
                unrecovered == 0)
    figures.add("same worker processes throughout (no restart)", "yes")
    lost_audit = sum(1 for r in records if r.audit_optional)
    figures.add("refused validations whose audit row could not be written (logged; by "
                "design best effort)", lost_audit)
    figures.add("history checker violations", len(violations), "0", not violations)
    figures.add("crashes", crashes, "0", crashes == 0)
    figures.notes += [str(v) for v in violations[:15]]
    assert not figures.failed(), figures.render()
