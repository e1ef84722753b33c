"""Scenario 2: takeover storm, 8 contenders x 1,000 rounds with validators running."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mos_lease import LeaseIdentity
from tests.faults.gateway import Gateway
from tests.faults.history import Kind, Op, Status
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

CONTENDERS = 8
IDENTITIES = 2  # few, so that every round is contended


def test_takeover_storm(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                        figures: Table, tmp_path: Path) -> None:
    rounds = scaled(soak, 200, 1000)
    prefix = run_prefix("s2")
    bindings = [f"b{i}" for i in range(IDENTITIES)]
    setup = Gateway({"dsn": pg_dsn, "process": "setup", "records": str(tmp_path / "setup.jsonl")})
    try:
        for binding in bindings:
            result = setup.acquire(LeaseIdentity(prefix, "agent", binding), ttl=30)
            assert result is not None and result.ok
    finally:
        setup.close()
    with workers_cleanup() as made:
        for p in range(CONTENDERS):
            made.append(Worker("storm", {
                "dsn": pg_dsn, "process": f"c{p}", "index": p, "tenant": prefix,
                "bindings": bindings, "rounds": rounds, "validators": 1, "keep": 3,
                "records": str(tmp_path / f"c{p}.jsonl"), "max_seconds": 600,
            }, tmp_path))
        start_together(made)
        summaries = [worker.finish(900) for worker in made]

    records, audit, finals, violations = recorded_history(admin, prefix, tmp_path.glob("*.jsonl"))

    takeovers = [r for r in records if r.op is Op.TAKEOVER]
    won = [r for r in takeovers if r.status is Status.OK]
    per_epoch = Counter((r.identity, r.epoch) for r in won)
    audit_wins = Counter((a.identity, a.epoch) for a in audit if a.outcome == "taken_over")
    validations = [r for r in records if r.op is Op.VALIDATE]
    val_status = Counter(r.status for r in validations)
    val_reasons = Counter(r.reason for r in validations if r.status is Status.DENIED)
    stale = [v for v in violations if v.kind in (Kind.STALE_ACCEPTED, Kind.TWO_VALID_LEASES)]
    rounds_done = sum(int(s["rounds"]) for s in summaries)
    crashes = sum(len(s["crashes"]) for s in summaries)
    top = {f.identity: f.epoch for f in finals}

    figures.add("spec. figure / this run", f"{CONTENDERS} x 1000 / {CONTENDERS} x {rounds}")
    figures.counts("contender rounds", CONTENDERS * rounds, rounds_done)
    figures.add("takeovers won / attempted", f"{len(won)} / {len(takeovers)}")
    figures.add("epochs reached", ", ".join(str(e) for e in sorted(top.values())),
                "= winners + 1 each", sum(top.values()) == len(won) + IDENTITIES)
    figures.add("epochs with exactly one winner (history)",
                sum(1 for n in per_epoch.values() if n == 1), f"= {len(per_epoch)}",
                all(n == 1 for n in per_epoch.values()))
    figures.add("epochs with exactly one winner (audit)",
                sum(1 for n in audit_wins.values() if n == 1), f"= {len(audit_wins)}",
                all(n == 1 for n in audit_wins.values()) and len(audit_wins) == len(won))
    figures.add("validations accepted / refused", f"{val_status[Status.OK]} / "
                f"{val_status[Status.DENIED]}")
    figures.add("refusal reasons", dict(val_reasons.most_common()))
    figures.add("stale validations accepted", len(stale), "0", not stale)
    figures.add("errors / unknown / crashes",
                f"{sum(r.status is Status.ERROR for r in records)} / "
                f"{sum(r.status is Status.UNKNOWN for r in records)} / {crashes}", "0",
                crashes == 0 and all(r.status in (Status.OK, Status.DENIED) for r in records))
    figures.add("history checker violations", len(violations), "0", not violations)
    for v in violations[:10]:
        figures.notes.append(str(v))
    assert not figures.failed(), figures.render()
