"""Scenario 1: acquire race, 16 processes x 500 identities -> exactly one winner each."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.faults.history import Op, Status
from tests.faults.support import (
    Table,
    Worker,
    recorded_history,
    run_prefix,
    scaled,
    start_together,
    workers_cleanup,
)

pytestmark = [pytest.mark.faults, pytest.mark.pg]

PROCESSES = 16


def test_acquire_race(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                      figures: Table, tmp_path: Path) -> None:
    count = scaled(soak, 100, 500)
    prefix = run_prefix("s1")
    bindings = [f"b{i}" for i in range(count)]
    with workers_cleanup() as made:
        for p in range(PROCESSES):
            made.append(Worker("race", {
                "dsn": pg_dsn, "process": f"racer{p}", "tenant": prefix, "bindings": bindings,
                "records": str(tmp_path / f"racer{p}.jsonl"), "max_seconds": 300,
            }, tmp_path))
        # Everyone starts at once and walks the identities in the same order: every
        # identity is contended by all sixteen at about the same instant.
        start_together(made)
        summaries = [worker.finish(300) for worker in made]

    records, audit, finals, violations = recorded_history(
        admin, prefix, tmp_path.glob("racer*.jsonl"))

    acquires = [r for r in records if r.op is Op.ACQUIRE]
    winners = Counter(r.identity for r in acquires if r.status is Status.OK)
    per_identity = Counter(winners.get((prefix, "agent", b), 0) for b in bindings)
    refusals = Counter(r.reason for r in acquires if r.status is Status.DENIED)
    other = [r for r in acquires if r.status not in (Status.OK, Status.DENIED)]
    crashes = sum(len(s["crashes"]) for s in summaries)

    figures.add("spec. figure / this run", f"{PROCESSES} x 500 / {PROCESSES} x {count}")
    figures.counts("processes x identities raced", PROCESSES * count,
                   PROCESSES * len({r.identity for r in acquires}))
    figures.add("acquire calls recorded", len(acquires), f"{PROCESSES * count}",
                len(acquires) == PROCESSES * count)
    figures.add("identities with exactly one winner", per_identity[1], f"= {count}",
                per_identity[1] == count)
    figures.add("identities with 0 or >1 winners", count - per_identity[1], "0",
                per_identity[1] == count)
    figures.add("losers refused lease_held", refusals["lease_held"],
                f"= {PROCESSES * count - count}", refusals["lease_held"] == (PROCESSES - 1) * count)
    figures.add("errors / unknown outcomes / crashes", f"{len(other)} / {crashes}", "0",
                not other and crashes == 0)
    figures.add("lease rows at epoch 1", sum(f.epoch == 1 for f in finals), f"= {count}",
                len(finals) == count and all(f.epoch == 1 for f in finals))
    figures.add("history checker violations", len(violations), "0", not violations)
    figures.add("audit rows checked", len(audit))
    for v in violations[:10]:
        figures.notes.append(str(v))
    assert not figures.failed(), figures.render()
