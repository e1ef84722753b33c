"""Scenario 4: gateway killed with SIGKILL mid-operation -> nothing stuck, old grants dead."""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.faults.history import Op, Status, check_history, read_records
from tests.faults.support import (
    Table,
    Worker,
    audit_rows,
    final_rows,
    percentile,
    run_prefix,
    scaled,
    workers_cleanup,
)

pytestmark = [pytest.mark.faults, pytest.mark.pg]

CHAINS = 4  # independent chains of gateways run side by side, each on its own identities
IDENTITIES_PER_CHAIN = 2
TTL = 0.6
# How long the server may take to notice a killed client's closed socket and end its backend.
BACKENDS_GONE_S = 10.0
# Only this run's database: other runs (and other engineers' tests) on the same server use
# the same application names, and their live backends are not ours to count.
VICTIM_BACKENDS = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                   "AND application_name LIKE 'faults-v%%'")


def backends_left(admin: psycopg.Connection[Any]) -> int:
    """The victims' backends still on the server, polled until none is left or the deadline
    passes (then the count at the deadline): a fixed sleep is either too short on a loaded
    machine or wasted on an idle one."""
    deadline = time.monotonic() + BACKENDS_GONE_S
    while True:
        row = admin.execute(VICTIM_BACKENDS).fetchone()
        assert row is not None
        if row[0] == 0 or time.monotonic() > deadline:
            return int(row[0])
        time.sleep(0.05)


def test_gateway_sigkill(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                         figures: Table, tmp_path: Path) -> None:
    trials_per_chain = scaled(soak, 4, 50)
    prefix = run_prefix("s4")
    rng = random.Random(4)
    summaries: list[dict[str, Any]] = []
    kills = 0

    def config(chain: int, trial: int, final: bool = False) -> dict[str, Any]:
        name = f"v{chain}-{trial}"
        return {
            "dsn": pg_dsn, "process": name, "connector": name, "tenant": prefix,
            "bindings": [f"c{chain}-b{i}" for i in range(IDENTITIES_PER_CHAIN)], "ttl": TTL,
            "records": str(tmp_path / f"{name}.jsonl"),
            "dump": str(tmp_path / f"{name}.grants"),
            "prev_dump": str(tmp_path / f"v{chain}-{trial - 1}.grants") if trial else None,
            "final": final, "seed": chain * 1000 + trial, "max_seconds": 30,
        }

    for trial in range(trials_per_chain + 1):
        final = trial == trials_per_chain
        with workers_cleanup() as made:
            for chain in range(CHAINS):
                made.append(Worker("victim", config(chain, trial, final), tmp_path))
            if final:
                summaries += [w.finish(60) for w in made]
                continue
            for worker in made:
                worker.wait_for("READY", 60)
            # Each victim works for a random while and is killed: the kill lands in
            # Python code, in a database round trip, or in between, wherever it falls.
            order = sorted((rng.uniform(0.02, 0.4), i) for i in range(len(made)))
            began = time.monotonic()
            for delay, i in order:
                time.sleep(max(0.0, began + delay - time.monotonic()))
                made[i].kill()
                kills += 1

    leftover = backends_left(admin)
    records = read_records(tmp_path.glob("*.jsonl"))
    audit = audit_rows(admin, prefix)
    violations = check_history(records, audit, final_rows=final_rows(admin, prefix))

    in_flight = [r for r in records if r.status is Status.UNKNOWN and r.end is None]
    cut_ops = Counter(str(r.op) for r in in_flight)
    replayed = sum(int(s["replayed"]) for s in summaries)
    replayed_ok = sum(int(s["replayed_ok"]) for s in summaries)
    stuck = [x for s in summaries for x in s["stuck"]]
    # Every restarted gateway recorded its own replays: count those of all generations.
    replays = [r for r in records if r.op is Op.VALIDATE and "-replay" in r.correlation_id]
    replays_ok = [r for r in replays if r.status is Status.OK]
    waits = [float(w) for s in summaries for w in s["waits"]]
    crashes = sum(len(s["crashes"]) for s in summaries)

    figures.add("spec. figure / this run", f"200 trials / {kills} kills "
                f"({CHAINS} chains x {trials_per_chain})")
    figures.counts("SIGKILL trials", CHAINS * trials_per_chain, kills)
    figures.add("kills that cut a call in flight", dict(cut_ops.most_common()),
                "some", len(in_flight) > 0)
    figures.add("identities stuck (no takeover after expiry)", len(stuck), "0", not stuck)
    # Every generation first takes over (or acquires) each identity of its chain, after the
    # previous one was killed; the harness waits for that before killing it in turn.
    taken = {(r.process, r.identity) for r in records if r.status is Status.OK
             and r.op in (Op.ACQUIRE, Op.TAKEOVER)}
    generations = CHAINS * (trials_per_chain + 1)
    figures.add("identities taken over by restarted gateways (all generations)", len(taken),
                f">= {generations * IDENTITIES_PER_CHAIN}",
                len(taken) >= generations * IDENTITIES_PER_CHAIN and not stuck)
    figures.add("last generation's wait for expiry, p50 / max (s)",
                f"{percentile(waits, 0.5):.2f} / {max(waits, default=0):.2f}",
                f"<= ttl {TTL} + 5", max(waits, default=0) <= TTL + 5)
    figures.add("old grants replayed to restarted gateways",
                f"{len(replays)} ({replayed} of them to the last generation)")
    figures.add("old grants accepted", len(replays_ok) + replayed_ok, "0",
                not replays_ok and replayed_ok == 0)
    figures.add("server backends left by killed gateways", leftover, "0", leftover == 0)
    figures.add("history checker violations", len(violations), "0", not violations)
    figures.add("crashes", crashes, "0", crashes == 0)
    for v in violations[:10]:
        figures.notes.append(str(v))
    assert not figures.failed(), figures.render()
