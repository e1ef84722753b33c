"""Two supervisor processes over the same bindings on PostgreSQL: the holder and a standby.

    python bench/standby.py [--bindings 10000] [--ttl 15] [--quick]

Finds PostgreSQL as the tests do and works in a throwaway database. Each side is a process
of its own (this script run with ``--child``), a thread :class:`Supervisor` on one
``PostgresLeaseStore`` whose calls are counted:

* ``acquire_10k_s``: the holder adds ``--bindings`` bindings to the empty database; seconds
  until every one is held (the first pass reads, then acquires, in batches);
* ``standby_round_trips_10k``: a standby with ``notices=LeaseNotices(dsn)`` adds the same
  bindings and waits; its store calls over ``ttl`` seconds of the holder's renewals, per
  renewal tick of the holder (one every ``ttl / 3``);
* ``standby_cpu_10k_vs_holder``: the CPU time (``/proc``) the standby used over those
  ``ttl`` seconds, over the holder's in the same window;
* ``takeover_10k_p99_after_expiry_s``: the holder is killed (``SIGKILL``); for each binding,
  the standby's wall time when it reported the binding started, minus the expiry of the
  holder's lease (the database's time, read after the kill; one machine, one clock); the
  99th percentile;
* ``close_10k_s``: the standby's ``close()``, every lease released (``release_many``).

Both processes start with the garbage collector's thresholds of the recipes' gateways
(``examples/recipes/command.py``: ``tune_gc()``), as the fleet benchmark's members do: a
process of 10,000 bindings at the default thresholds spends a tenth to a fifth of these
figures in full collections ("A gateway process at this size" in ``docs/fleet.md``).

Absolute figures on a shared machine are noise. Exit status: 0 ran, 2 could not run (no
server), 3 a correctness check failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import IO, Any

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import psycopg
from common import SCOPES, BenchError, CorrectnessError, failed, server, throwaway_database

from examples.recipes.command import tune_gc
from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.supervisor import BindingStarted, Change, Supervisor
from mos_lease_pg import LeaseNotices, PostgresLeaseStore

TARGETS = {"acquire_10k_s": 2.0, "close_10k_s": 1.0, "standby_round_trips_10k": 11.0,
           "standby_cpu_10k_vs_holder": 1.0, "takeover_10k_p99_after_expiry_s": 1.0}


class Counted:
    """A store whose calls are counted (every public method call is one round trip)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if not callable(attribute) or name.startswith("_") or name == "close":
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls += 1
            return attribute(*args, **kwargs)

        return counted


def identities(n: int) -> list[LeaseIdentity]:
    return [LeaseIdentity("bench-standby", f"agent-{i}", "b") for i in range(n)]


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def child(role: str, dsn: str, n: int, ttl: float) -> None:
    """One process: hold (``holder``) or wait for (``standby``) ``n`` bindings, reporting
    as JSON lines; commands come on stdin (``calls``, ``close``)."""
    tune_gc()  # as the recipes' gateways do
    store = PostgresLeaseStore(dsn)
    counted = Counted(store)
    coordinator = ConnectorLeaseCoordinator(counted, AllowAllPolicy())
    started: dict[str, float] = {}
    lock = threading.Lock()

    def on_change(change: Change) -> None:
        if isinstance(change, BindingStarted):
            with lock:
                started[change.identity.logical_agent_id] = time.time()

    notices = LeaseNotices(dsn) if role == "standby" else None
    supervisor = Supervisor(coordinator, on_change=on_change, notices=notices)
    t0 = time.perf_counter()
    for identity in identities(n):
        supervisor.add(identity, f"gw-{role}", scopes=SCOPES, ttl=ttl)
    if role == "holder":
        while len(started) < n:
            time.sleep(0.01)
        say(event="held", seconds=time.perf_counter() - t0)
    else:
        say(event="added")
    for line in sys.stdin:
        command = line.strip()
        if command == "calls":
            with lock:
                say(event="calls", calls=counted.calls, held=len(started))
        elif command == "started":
            with lock:
                say(event="started", started=started)
        elif command == "close":
            t1 = time.perf_counter()
            supervisor.close(timeout=60)
            say(event="closed", seconds=time.perf_counter() - t1)
            break
    if notices is not None:
        notices.close()
    store.close()


class Child:
    def __init__(self, role: str, dsn: str, n: int, ttl: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--child", role, "--dsn", dsn, "--bindings", str(n),
             "--ttl", str(ttl)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        assert self.process.stdout is not None
        threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(json.loads(line))

    def ask(self, command: str, timeout: float = 120.0) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.expect(timeout)

    def expect(self, timeout: float = 300.0) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise BenchError("a child process did not answer in time") from None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process ``pid`` has used so far, from ``/proc``."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _settle(standby: Child, n: int) -> None:
    """Until the standby's first pass (one batched read of every holder) is over: its call
    count stops moving."""
    deadline = time.monotonic() + 60
    last = -1
    while True:
        time.sleep(1.0)
        calls = standby.ask("calls")["calls"]
        if calls == last and calls >= n // 1000:
            return
        if time.monotonic() > deadline:
            raise BenchError("the standby never settled")
        last = calls


def _waiting(holder: Child, standby: Child, ttl: float) -> dict[str, float]:
    """The standby's round trips per holder tick and both sides' CPU over ``ttl`` seconds
    (three renewal ticks of the holder)."""
    before = standby.ask("calls")
    cpu = (cpu_seconds(holder.process.pid), cpu_seconds(standby.process.pid))
    time.sleep(ttl)
    holder_cpu = cpu_seconds(holder.process.pid) - cpu[0]
    standby_cpu = cpu_seconds(standby.process.pid) - cpu[1]
    after = standby.ask("calls")
    if after["held"]:
        raise CorrectnessError("the standby took a lease the holder still held")
    return {"standby_round_trips_10k": (after["calls"] - before["calls"]) / 3,
            "standby_cpu_s": standby_cpu, "holder_cpu_s": holder_cpu,
            "standby_cpu_10k_vs_holder": (standby_cpu / holder_cpu if holder_cpu > 0
                                          else math.inf)}


def _audited_takeovers(dsn: str, n: int) -> int:
    """The audit log after the failover: exactly one successful takeover per binding, by
    the standby, at epoch 2 (the holder's epoch + 1), and every lease row at that epoch
    and held by the standby. Returns the takeover rows counted."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT logical_agent_id), min(epoch), max(epoch), "
            "bool_and(connector_id = 'gw-standby') "
            "FROM mos_lease.connector_lease_audit_log "
            "WHERE event = 'takeover' AND outcome = 'taken_over'").fetchone()
        leases = conn.execute(
            "SELECT count(*) FILTER (WHERE epoch = 2 AND connector_id = 'gw-standby'), "
            "count(*) FROM mos_lease.logical_agent_connector_leases").fetchone()
    if row is None or leases is None or tuple(row) != (n, n, 2, 2, True) \
            or tuple(leases) != (n, n):
        raise CorrectnessError(f"audit after the failover: takeovers (rows, bindings, "
                               f"min epoch, max epoch, all by the standby) {row}, lease "
                               f"rows at epoch 2 by the standby {leases}, for {n} bindings")
    return int(row[0])


def run(dsn: str, n: int, ttl: float) -> dict[str, float]:
    figures: dict[str, float] = {}
    holder = Child("holder", dsn, n, ttl)
    standby: Child | None = None
    try:
        figures["acquire_10k_s"] = holder.expect()["seconds"]
        standby = Child("standby", dsn, n, ttl)
        standby.expect()
        _settle(standby, n)
        figures.update(_waiting(holder, standby, ttl))
        holder.kill()
        reader_store = PostgresLeaseStore(dsn)
        reader = ConnectorLeaseCoordinator(reader_store, AllowAllPolicy())
        names = identities(n)
        expiry: dict[str, float] = {}
        for first in range(0, n, 1000):
            for identity, view in zip(names[first:first + 1000],
                                      reader.current_holders(names[first:first + 1000]),
                                      strict=True):
                if view is None or view.connector_id != "gw-holder":
                    raise CorrectnessError(f"{identity} was not the holder's at the kill")
                expiry[identity.logical_agent_id] = view.expires_at.timestamp()
        reader_store.close()
        deadline = time.monotonic() + ttl + 120
        while standby.ask("calls")["held"] < n:
            if time.monotonic() > deadline:
                raise CorrectnessError("the standby did not take every binding over")
            time.sleep(0.5)
        started = standby.ask("started")["started"]
        after_expiry = sorted(started[name] - expiry[name] for name in expiry)
        if after_expiry[0] < 0:
            raise CorrectnessError("a lease was taken over before its expiry")
        figures["takeover_10k_p99_after_expiry_s"] = after_expiry[int(0.99 * (n - 1))]
        figures["takeover_10k_median_after_expiry_s"] = statistics.median(after_expiry)
        figures["takeover_audit_rows"] = _audited_takeovers(dsn, n)
        figures["close_10k_s"] = standby.ask("close")["seconds"]
    finally:
        for side in (holder, standby):
            if side is not None and side.process.poll() is None:
                side.kill()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bindings", type=int, default=10_000)
    parser.add_argument("--ttl", type=float, default=15.0)
    parser.add_argument("--quick", action="store_true", help="1,000 bindings, ttl 6 s")
    parser.add_argument("--child", choices=("holder", "standby"))
    parser.add_argument("--dsn")
    args = parser.parse_args(argv)
    if args.quick:
        args.bindings, args.ttl = 1000, 6.0
    if args.child is not None:
        child(args.child, args.dsn, args.bindings, args.ttl)
        return 0
    try:
        srv = server()
        print(f"mos-lease standby benchmark: {args.bindings:,} bindings, ttl {args.ttl:g} s, "
              f"two processes; load average {os.getloadavg()[0]:.2f}", flush=True)
        with throwaway_database(srv, "mos_lease_bench_standby") as dsn:
            figures = run(dsn, args.bindings, args.ttl)
        for key, value in figures.items():
            target = TARGETS.get(key)
            print(f"{key:36} {value:10.3f}" + ("" if target is None
                                                else f"   (target {target:g})"))
        print(f"load average at end {os.getloadavg()[0]:.2f} (a shared machine)")
    except (BenchError, CorrectnessError) as error:
        return failed(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
