"""A fleet of real OS processes over one PostgreSQL database, and the figures it is held to.

Each member is ``tests/fleet_member.py``: a thread ``Supervisor`` with notices, joined to
one fleet, running the same 10,000 bindings (ttl 10 s, ``look`` 1 s, grace 5 s, a policy
that refuses preemption), with the recipes' garbage-collector thresholds
(``examples/recipes/command.py``: ``GC_THRESHOLDS``; ``docs/fleet.md`` says why). Every
figure is read from the audit log in database time:

- ``fleet_balance_2x10k``: two members started together; the larger share over the fair
  share (5,000) 3 x ttl after they started;
- ``fleet_join_p99_s``: a third member joins; p99 over the bindings it took over of the
  time from its member lease's acquire to the takeover (``fleet_join_from_start_p99_s``:
  from the moment its process was started); ``fleet_join_moved_vs_fair``: the bindings
  that moved over 10,000 / 3; ``fleet_join_unheld_max_s``: the longest time a moved binding
  had no active lease (its release to its successor's takeover);
- ``fleet_idle_round_trips_10k``: round trips per renewal tick of a member at steady state
  (10,000 bindings over three members; the member's own store only);
- ``fleet_sigterm_p99_s``: SIGTERM of one of three: p99 over its bindings of the time from
  the signal to the takeover; ``fleet_warnings``: WARNING lines logged by any member;
- ``fleet_sigkill_p99_after_expiry_s``: SIGKILL of one of three: p99 over its bindings of
  the time from the lease's expiry to its takeover.

- ``handover_ms_p50``: before the fleet starts, two gateway processes
  (``tests/handover_member.py``, a thread ``Supervisor`` with notices each) run one binding
  as connectors ``h1`` and ``h2`` and hand it back and forth (``Supervisor.handover``, no
  grant in flight); p50 over the hand-offs of the time from the command sent to the holder
  to the successor's report of its new lease (``handover_ms_p99`` beside it).

The run fails (exit 3) unless the audit log shows, for every binding, epochs going up by
one per acquire and takeover, no takeover asked of an active lease (``preemption_denied``,
which the policy would write), and exactly one takeover per moved binding in each phase
(for the hand-offs: one takeover each, at the next epoch, after a release naming it).

    python bench/fleet.py [--bindings N] [--json PATH]    (or bench/run.py --only fleet)
    python bench/fleet.py --handovers N --handover-only   (the hand-offs alone)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import psycopg
from common import BenchError, CorrectnessError, server, throwaway_database

from mos_lease.fleet.members import FLEET_TENANT
from mos_lease.keeper import KeeperTiming

ROOT = Path(__file__).resolve().parents[1]
BINDINGS = 10_000
TTL, LOOK, GRACE = 10.0, 1.0, 5.0
TENANT = "bench-fleet"
FLEET = "edge"
NAMES = ["p1", "p2", "p3"]
HANDOVERS = 50
HANDOVER_TENANT = "bench-handover"
PAUSE = 0.25  # seconds between two hand-offs
AUDIT = "mos_lease.connector_lease_audit_log"
LEASES = "mos_lease.logical_agent_connector_leases"


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered \
        else math.nan


class Fleet:
    def __init__(self, dsn: str, bindings: int, logs: Path) -> None:
        self.dsn, self.bindings, self.logs = dsn, bindings, logs
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.conn = psycopg.connect(dsn, autocommit=True)

    def start(self, *names: str) -> None:
        for name in names:
            stderr = (self.logs / f"{name}.{time.monotonic_ns()}.err").open("w")
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.fleet_member", self.dsn, FLEET, name,
                 ",".join(NAMES), TENANT, str(self.bindings), str(TTL), str(LOOK),
                 str(GRACE)], cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
        for name in names:
            line = self.procs[name].stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "started":
                raise BenchError(f"member {name} did not start: {line!r}")

    def stop(self, name: str, how: signal.Signals) -> datetime:
        process = self.procs.pop(name)
        at = self.now()
        process.send_signal(how)
        process.wait(60)
        return at

    def stats(self, name: str) -> dict[str, int]:
        process = self.procs[name]
        process.send_signal(signal.SIGUSR1)
        assert process.stdout is not None
        answer: dict[str, int] = json.loads(process.stdout.readline())
        return answer

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name, signal.SIGTERM)
        self.conn.close()

    def now(self) -> datetime:
        row = self.conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    def rows(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        return self.conn.execute(query, params).fetchall()

    def shares(self) -> Counter[str | None]:
        held = dict(self.rows(
            f"SELECT connector_id, count(*) FROM {LEASES} WHERE tenant_id = %s "
            "AND released_at IS NULL AND expires_at > clock_timestamp() GROUP BY 1", TENANT))
        held[None] = self.bindings - sum(held.values())
        return Counter({k: v for k, v in held.items() if v})

    def holders(self, connector: str) -> dict[str, datetime]:
        return dict(self.rows(f"SELECT logical_agent_id, expires_at FROM {LEASES} "
                              "WHERE tenant_id = %s AND connector_id = %s", TENANT, connector))

    def takeovers(self, after: datetime) -> list[tuple[str, str, datetime]]:
        return [(a, c, t) for a, c, t in self.rows(
            f"SELECT logical_agent_id, connector_id, recorded_at FROM {AUDIT} "
            "WHERE tenant_id = %s AND outcome = 'taken_over' AND recorded_at > %s "
            "ORDER BY seq", TENANT, after)]

    def wait_for(self, check: Any, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not check(self.shares()):
            if time.monotonic() > end:
                raise CorrectnessError(f"timed out; shares {self.shares()}")
            time.sleep(0.1)


def _balanced(names: set[str], bindings: int) -> Any:
    cap = math.ceil(1.1 * bindings / len(names))
    return lambda s: set(s) == names and max(s.values()) <= cap


def _once_each(taken: list[tuple[str, str, datetime]], what: str) -> dict[str, datetime]:
    counts = Counter(agent for agent, _, _ in taken)
    again = {agent: n for agent, n in counts.items() if n != 1}
    if again:
        agent = next(iter(again))
        story = [(c, t.isoformat()) for a, c, t in taken if a == agent]
        raise CorrectnessError(f"{what}: {len(again)} bindings taken over more than once, "
                               f"e.g. {agent}: {story}")
    return {agent: at for agent, _, at in taken}


def run(bindings: int, handovers: int = HANDOVERS, fleet_too: bool = True
        ) -> dict[str, Any]:
    with throwaway_database(server(), "mos_lease_bench_fleet") as dsn, \
            tempfile.TemporaryDirectory() as logs:
        figures = _handovers(dsn, handovers, Path(logs))
        if not fleet_too:
            return figures
        fleet = Fleet(dsn, bindings, Path(logs))
        try:
            return {**figures, **_phases(fleet, bindings, Path(logs))}
        finally:
            fleet.close()


class _Gateway:
    """One ``tests/handover_member.py`` process: its output lines, read on a thread."""

    def __init__(self, dsn: str, name: str, logs: Path) -> None:
        stderr = (logs / f"{name}.{time.monotonic_ns()}.err").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.handover_member", dsn, HANDOVER_TENANT, name,
             str(TTL)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=stderr, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str) -> str:
        try:
            line = self.lines.get(timeout=30)
        except queue.Empty:
            raise CorrectnessError(f"no {prefix!r} from a hand-off gateway in 30 s") from None
        if not line.startswith(prefix):
            raise CorrectnessError(f"a hand-off gateway said {line!r}, not {prefix!r}")
        return line

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(30)


def _handovers(dsn: str, count: int, logs: Path) -> dict[str, Any]:
    """``handover_ms_p50``: ``count`` hand-offs of one binding between two gateway
    processes, each timed from the command to the successor's report of its lease; then the
    audit log's check of them."""
    gateways = {"h1": _Gateway(dsn, "h1", logs)}
    try:
        gateways["h1"].expect("started 1")
        gateways["h2"] = _Gateway(dsn, "h2", logs)
        time.sleep(1.0)  # h2 has read the holder, and waits for it
        samples = []
        holder, successor = "h1", "h2"
        for n in range(count):
            began = time.perf_counter()
            gateways[holder].send(f"handover {successor}")
            gateways[successor].expect(f"started {n + 2}")
            samples.append((time.perf_counter() - began) * 1000)
            gateways[holder].expect("handed ok")
            holder, successor = successor, holder
            # One binding's hand-offs are rare: back to back they would measure the
            # notice confirmer's rate bound (20 confirming turns a second) instead.
            time.sleep(PAUSE)
    finally:
        for gateway in gateways.values():
            gateway.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT outcome, epoch, correlation_id FROM {AUDIT} "
                            "WHERE tenant_id = %s AND outcome <> 'renewed' ORDER BY seq",
                            (HANDOVER_TENANT,)).fetchall()
    # Acquired at 1, then per hand-off a release naming the successor and its takeover at
    # the next epoch; nothing else (no refusal: the old holder never raced its successor).
    # Then the gateways' close (a release, perhaps a takeover by the one still running).
    expected: list[tuple[str, int, str | None]] = [("acquired", 1, None)]
    for k in range(count):
        expected += [("released", k + 1, f"handover:{('h2', 'h1')[k % 2]}"),
                     ("taken_over", k + 2, None)]
    seen = [(o, e, r if o == "released" else None) for o, e, r in rows]
    wins = [e for o, e, _ in seen if o in ("acquired", "taken_over")]
    if seen[:len(expected)] != expected or wins != list(range(1, len(wins) + 1)) \
            or any(o == "denied" for o, _, _ in seen):
        first = next((k for k, (a, b) in enumerate(zip(seen, expected, strict=False))
                      if a != b), len(expected))
        raise CorrectnessError(f"hand-offs: audit rows {seen[first:first + 3]} where "
                               f"{expected[first:first + 3]} were expected")
    ordered = sorted(samples)
    return {"handover_ms_p50": ordered[len(ordered) // 2], "handover_ms_p99": p99(samples),
            "handovers": count, "handover_samples_ms": [round(x, 1) for x in samples]}


def _phases(fleet: Fleet, bindings: int, logs: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {"bindings": bindings, "ttl_s": TTL, "look_s": LOOK,
                               "grace_s": GRACE}
    started = time.monotonic()
    fleet.start("p1", "p2")
    time.sleep(max(0.0, started + 3 * TTL - time.monotonic()))
    shares = fleet.shares()
    figures["fleet_balance_2x10k"] = max(shares.values()) / (bindings / 2)
    figures["balance_shares"] = {str(k): v for k, v in shares.items()}
    fleet.wait_for(_balanced({"p1", "p2"}, bindings), 60)

    joined_at = fleet.now()
    fleet.start("p3")
    fleet.wait_for(_balanced(set(NAMES), bindings), 60)
    time.sleep(2 * LOOK)  # any hand-off after balance is counted too
    member = fleet.rows(f"SELECT min(recorded_at) FROM {AUDIT} WHERE tenant_id = %s "
                        "AND logical_agent_id = %s AND binding_id = 'p3' "
                        "AND outcome IN ('acquired', 'taken_over') AND recorded_at > %s",
                        FLEET_TENANT, FLEET, joined_at)[0][0]
    moved = _once_each(fleet.takeovers(joined_at), "join")
    released = dict(fleet.rows(
        f"SELECT logical_agent_id, max(recorded_at) FROM {AUDIT} WHERE tenant_id = %s "
        "AND outcome = 'released' AND recorded_at > %s GROUP BY 1", TENANT, joined_at))
    figures["fleet_join_p99_s"] = p99([(at - member).total_seconds()
                                       for at in moved.values()])
    figures["fleet_join_from_start_p99_s"] = p99([(at - joined_at).total_seconds()
                                                  for at in moved.values()])
    figures["fleet_join_moved_vs_fair"] = len(moved) / (bindings / 3)
    figures["fleet_join_unheld_max_s"] = max(
        (at - released[agent]).total_seconds() for agent, at in moved.items())
    _steady_and_leaving(fleet, bindings, figures)
    _audited(fleet, logs, figures)
    return figures


def _steady_and_leaving(fleet: Fleet, bindings: int, figures: dict[str, Any]) -> None:
    """Idle round trips at steady state, then SIGTERM of a member, its restart, SIGKILL."""
    tick = TTL * KeeperTiming(TTL).renew_fraction
    first, began = fleet.stats("p1"), time.monotonic()
    time.sleep(3 * tick)
    last, window = fleet.stats("p1"), time.monotonic() - began
    figures["fleet_idle_round_trips_10k"] = (last["round_trips"] - first["round_trips"]) \
        / (window / tick)

    leaving = fleet.holders("p2")
    signalled = fleet.stop("p2", signal.SIGTERM)
    fleet.wait_for(_balanced({"p1", "p3"}, bindings), 60)
    taken = _once_each(fleet.takeovers(signalled), "SIGTERM")
    if set(taken) != set(leaving):
        raise CorrectnessError("SIGTERM: the stopped member's bindings and those taken over "
                               "differ")
    figures["fleet_sigterm_p99_s"] = p99([(at - signalled).total_seconds()
                                          for at in taken.values()])

    fleet.start("p2")  # rejoins: three members again before one is killed
    fleet.wait_for(_balanced(set(NAMES), bindings), 60)
    time.sleep(2 * LOOK)
    killed = fleet.stop("p3", signal.SIGKILL)
    expiries = fleet.holders("p3")  # final: nobody renews them any more
    fleet.wait_for(lambda s: None not in s and "p3" not in s, TTL + 30)
    taken = _once_each(fleet.takeovers(killed), "SIGKILL")
    figures["fleet_sigkill_p99_after_expiry_s"] = p99(
        [(at - expiries[agent]).total_seconds() for agent, at in taken.items()
         if agent in expiries])
    if set(taken) != set(expiries):
        raise CorrectnessError("SIGKILL: the killed member's bindings and those taken over "
                               "differ")


def _audited(fleet: Fleet, logs: Path, figures: dict[str, Any]) -> None:
    """The audit log's checks over the whole run, and the members' warnings."""
    fleet.close()

    preempted = fleet_rows(fleet, f"SELECT count(*) FROM {AUDIT} WHERE tenant_id = %s "
                           "AND reason = 'preemption_denied'")
    if preempted:
        raise CorrectnessError(f"{preempted} takeovers were asked of an active lease")
    gaps = fleet_rows(fleet, f"""SELECT count(*) FROM (
        SELECT epoch, row_number() OVER (PARTITION BY logical_agent_id ORDER BY seq) AS n
        FROM {AUDIT} WHERE tenant_id = %s AND outcome IN ('acquired', 'taken_over')) e
        WHERE epoch <> n""")
    if gaps:
        raise CorrectnessError(f"{gaps} acquires or takeovers not at the next epoch")
    warnings = [line for err in sorted(logs.glob("*.err"))
                for line in err.read_text().splitlines()
                if " WARNING " in line and "privileges it never uses" not in line]
    figures["fleet_warnings"] = len(warnings)
    figures["fleet_warning_sample"] = warnings[:5]


def fleet_rows(fleet: Fleet, query: str) -> int:
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        row = conn.execute(query, (TENANT,)).fetchone()
    assert row is not None
    return int(row[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bindings", type=int, default=BINDINGS)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--handovers", type=int, default=HANDOVERS)
    parser.add_argument("--handover-only", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    try:
        figures = run(args.bindings, args.handovers, fleet_too=not args.handover_only)
    except CorrectnessError as failed:
        print(f"correctness: {failed}", file=sys.stderr)
        return 3
    except BenchError as failed:
        print(f"cannot run: {failed}", file=sys.stderr)
        return 2
    text = json.dumps(figures, indent=2, default=str)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
