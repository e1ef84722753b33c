"""Failover under a real HA manager: three nodes under Patroni (strict synchronous mode),
gateways in the takeover storm on a multi-host DSN over all three, checked by the same
history checker as the other failover tests.

(a) The leader's machine dies (its Patroni and its postmaster killed together): the
synchronous standby becomes leader, the other standby its synchronous one, writes resume.
(b) Only the leader's postmaster dies: Patroni restarts it in place (no failover).
Each prints the seconds from the kill to the first acknowledged gateway write.

Without Patroni or etcd (Debian ``patroni``, ``etcd-server``) these tests skip, or fail where
``MOS_LEASE_REQUIRE_TOOLS=1`` (``tests/tools.py``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from mos_lease_pg.admin import migrate
from tests import tools
from tests.failover.patroni import PatroniCluster, PatroniNode
from tests.failover.support import cluster_programs
from tests.failover.test_failover_load import (
    GATEWAYS,
    WRITES,
    gateway_config,
    held_bindings,
    lost_acknowledgements,
    reissued_epochs,
    widened,
)
from tests.faults.history import Op, OpRecord, Status, check_history, read_records
from tests.faults.support import (
    Worker,
    audit_rows,
    final_rows,
    run_prefix,
    start_together,
    workers_cleanup,
)
from tests.pg_support import unique_name

BEFORE_KILL = 2.0  # seconds of load on the healthy cluster
# With ttl 10 s the leader key outlives a dead leader by up to 10 s; then a promotion, and
# the new leader's synchronous standby is named. The storm runs this long after the kill.
AFTER_KILL = {"machine": 30.0, "postmaster": 15.0}
RESUMED_WITHIN = {"machine": 25.0, "postmaster": 12.0}


def resumed_after(acknowledged: list[OpRecord], killed_at: float) -> float:
    """Seconds from the kill to the end of the first acknowledged write after the outage:
    the longest pause between acknowledgements from the kill on. (Not simply the first
    write after the kill: a backend of a SIGKILLed postmaster lives on for a moment, and
    may still commit, with its synchronous standby's confirmation.)"""
    ends = sorted([killed_at, *(float(r.args["m1"]) for r in acknowledged
                                if float(r.args["m1"]) >= killed_at)])
    if len(ends) < 2:
        return float("inf")
    gap = max(range(1, len(ends)), key=lambda i: ends[i] - ends[i - 1])
    return ends[gap] - killed_at


@pytest.fixture
def cluster() -> Iterator[PatroniCluster]:
    tools.need(tools.PATRONI, tools.ETCD)
    made = PatroniCluster(cluster_programs())
    try:
        yield made.start()
    finally:
        made.close()


def _database(cluster: PatroniCluster) -> str:
    leader = cluster.leader()
    assert leader is not None
    name = unique_name("pt")
    with psycopg.connect(leader.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = cluster.dsn(name)
    migrate(dsn)
    return dsn


def _storm_through(cluster: PatroniCluster, tmp_path: Path, kind: str,
                   kill: Callable[[PatroniNode], None],
                   capsys: pytest.CaptureFixture[str]) -> tuple[PatroniNode, PatroniNode]:
    """The storm; ``kill`` the leader after BEFORE_KILL seconds. Returns the leaders before
    and after."""
    dsn = _database(cluster)
    prefix = run_prefix("pt")
    bindings = held_bindings(dsn, prefix, tmp_path)
    seconds = BEFORE_KILL + AFTER_KILL[kind]
    before = cluster.leader()
    assert before is not None
    with workers_cleanup() as made:
        for p in range(GATEWAYS):
            made.append(Worker("storm", gateway_config(
                dsn, f"g{p}", tmp_path, index=p, tenant=prefix, bindings=bindings,
                rounds=10**7, validators=1, keep=3, max_seconds=seconds), tmp_path))
        made.append(Worker("load", gateway_config(
            dsn, "l0", tmp_path, tenant=prefix, bindings=["l-b0", "l-b1"], ttl=60, seed=1,
            stop_file=str(tmp_path / "stop"), max_seconds=seconds), tmp_path))
        start_together(made)
        time.sleep(BEFORE_KILL)
        killed_at = time.monotonic()
        kill(before)
        after = cluster.wait_healthy(seconds=60, standbys=1 if kind == "machine" else 2)
        healthy = time.monotonic() - killed_at
        summaries = [worker.finish(seconds + 60) for worker in made]

    records = [widened(r) for r in read_records(tmp_path.glob("*.jsonl"))]
    with psycopg.connect(after.dsn(str(conninfo_to_dict(dsn)["dbname"])),
                         autocommit=True) as conn:
        audit = audit_rows(conn, prefix)
        finals = final_rows(conn, prefix)
    violations = check_history(records, audit, final_rows=finals)
    acknowledged = [r for r in records if r.op in WRITES and r.status is Status.OK]
    first = resumed_after(acknowledged, killed_at)
    crashes = [c for s in summaries for c in s["crashes"]]
    with capsys.disabled():
        print(f"\npatroni ({kind} killed): leader {before.name} -> {after.name}; "
              f"kill -> cluster healthy {healthy:.2f} s; kill -> first acknowledged gateway "
              f"write {first:.2f} s; acknowledged writes {len(acknowledged)}; "
              f"ops: {dict(Counter(f'{r.op}:{r.status}' for r in records))}")
    assert not crashes, crashes
    assert not lost_acknowledgements(records, audit)
    assert not reissued_epochs(records)
    assert not violations, [str(v) for v in violations[:10]]
    assert first < RESUMED_WITHIN[kind], f"writes resumed {first:.2f} s after the kill"
    assert any(r.op is Op.TAKEOVER for r in acknowledged
               if float(r.args["m0"]) >= killed_at + first)
    return before, after


def test_patroni_fails_over_when_the_leader_machine_dies(
        cluster: PatroniCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before, after = _storm_through(cluster, tmp_path, "machine",
                                   cluster.kill_patroni_and_postmaster, capsys)
    assert after is not before


def test_patroni_restarts_a_crashed_postmaster_in_place(
        cluster: PatroniCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    killed: list[int] = []
    before, after = _storm_through(cluster, tmp_path, "postmaster",
                                   lambda node: killed.append(cluster.kill_postmaster(node)),
                                   capsys)
    assert after is before  # no failover
    assert before.postmaster_pid() not in (None, *killed)  # a new postmaster


@pytest.mark.parametrize("require", [False, True])
def test_without_patroni_it_skips_naming_the_packages_or_fails_when_required(
        require: bool) -> None:
    output = tools.run_without_tools(
        "tests/failover/test_patroni.py::test_patroni_restarts_a_crashed_postmaster_in_place",
        require=require)
    assert ("patroni, etcd not installed (Debian: apt-get install patroni etcd-server)"
            in output), output
    if require:
        # The fixture fails, so the test errors at setup.
        assert "1 error" in output and "MOS_LEASE_REQUIRE_TOOLS is set" in output, output
    else:
        assert "1 skipped" in output and "error" not in output, output
