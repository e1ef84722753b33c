"""What the fault scenarios share: figure tables, worker processes, database reads and a
private PostgreSQL cluster that may be stopped.

Nothing here touches the shared server's life: scenarios that stop PostgreSQL start their
own throwaway cluster (:class:`PrivateCluster`).
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from tests.faults.history import (
    AuditRow,
    FinalRow,
    Ident,
    OpRecord,
    Violation,
    check_history,
    read_records,
)
from tests.pg_support import PairedRelay, server_programs
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def scaled(soak: bool, short: int, full: int) -> int:
    """The count a scenario runs: ``full`` (the full figure) under ``--soak``."""
    return full if soak else short


def run_prefix(name: str) -> str:
    """A tenant prefix no other run or scenario uses; every identity of a scenario starts
    with it, which is how its audit rows and lease rows are found again."""
    return f"f{name}-{secrets.token_hex(4)}"


# --- figure tables ------------------------------------------------------------------------


@dataclass
class Figure:
    name: str
    value: object
    required: str = ""
    ok: bool | None = None


@dataclass
class Table:
    scenario: str
    mode: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, name: str, value: object, required: str = "",
            ok: bool | None = None) -> None:
        self.figures.append(Figure(name, value, required, ok))

    def counts(self, name: str, configured: int, achieved: int) -> None:
        """A count the specification names: what was configured and what actually ran."""
        self.add(name, f"{achieved} of {configured} configured", "",
                 achieved >= configured)

    def render(self) -> str:
        rows = [("figure", "value", "required", "holds")]
        for f in self.figures:
            holds = "" if f.ok is None else ("yes" if f.ok else "NO")
            rows.append((f.name, _text(f.value), f.required, holds))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        head = f"== {self.scenario} [{self.mode}] ({self.seconds:.1f} s)"
        lines = [head]
        for i, row in enumerate(rows):
            lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths,
                                                                     strict=True)) + " |")
            if i == 0:
                lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def failed(self) -> list[Figure]:
        return [f for f in self.figures if f.ok is False]

    def to_json(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "mode": self.mode, "seconds": self.seconds,
                "figures": [{"name": f.name, "value": _text(f.value), "required": f.required,
                             "ok": f.ok} for f in self.figures],
                "notes": self.notes}


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def save_table(table: Table, directory: Path) -> None:
    """Append the table to this run's figures files (Markdown and JSON lines)."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / f"figures-{table.mode}.md").open("a", encoding="utf-8") as out:
        out.write(table.render() + "\n\n")
    with (directory / f"figures-{table.mode}.jsonl").open("a", encoding="utf-8") as out:
        out.write(json.dumps(table.to_json()) + "\n")


# --- worker processes ---------------------------------------------------------------------


class WorkerError(AssertionError):
    pass


class Worker:
    """One worker OS process: ``python -m tests.faults.workers ROLE CONFIG``.

    The protocol is lines on stdin/stdout: the worker prints ``READY`` when set up, waits
    for ``GO`` where the role needs a common start, and prints ``SUMMARY {json}`` last.
    stderr goes to a file (a full pipe would block the worker).
    """

    def __init__(self, role: str, config: Mapping[str, Any], workdir: Path, *,
                 skew: tuple[float, float] | None = None) -> None:
        self.name = str(config.get("process", role))
        self.workdir = workdir
        cfg_path = workdir / f"{self.name}.config.json"
        cfg_path.write_text(json.dumps(config), encoding="utf-8")
        self.stderr_path = workdir / f"{self.name}.stderr"
        command = [sys.executable, "-X", "utf8", "-m"]
        if skew is not None:
            command += ["tests.faults.clockskew", repr(skew[0]), repr(skew[1]), "--",
                        "tests.faults.workers"]
        else:
            command += ["tests.faults.workers"]
        command += [role, str(cfg_path)]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        # Worker processes must not turn their own warnings into crashes of the harness,
        # but must not hide them either: they go to the stderr file.
        env.pop("PYTHONWARNINGS", None)
        self._stderr = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, cwd=ROOT, env=env)
        self._buffer = b""
        self.lines: list[str] = []
        self.summary: dict[str, Any] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_some(self, timeout: float) -> bool:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
        if not ready:
            return True
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            text = line.decode("utf-8", "replace")
            self.lines.append(text)
            if text.startswith("SUMMARY "):
                self.summary = json.loads(text[len("SUMMARY "):])
        return True

    def wait_for(self, word: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while word not in self.lines:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.name}: no {word} within {timeout} s; "
                                  f"stderr: {self.stderr_tail()}")
            if not self._read_some(min(left, 0.2)):
                raise WorkerError(f"{self.name} exited before {word}: {self.stderr_tail()}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def finish(self, timeout: float) -> dict[str, Any]:
        """Wait for the worker to exit by itself and return its summary."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerError(f"{self.name} did not finish within {timeout} s; "
                                  f"stderr: {self.stderr_tail()}")
            if not self._read_some(min(left, 0.2)):
                break  # end of its stdout: it exited
        try:
            self.proc.wait(timeout=max(0.5, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise WorkerError(f"{self.name} closed stdout but did not exit") from None
        self._close_pipes()
        if self.proc.returncode != 0 or self.summary is None:
            raise WorkerError(f"{self.name} exited with {self.proc.returncode}; "
                              f"stderr: {self.stderr_tail()}")
        return self.summary

    def kill(self) -> None:
        """SIGKILL and reap (no zombie, no open pipe left for -W error to complain of)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._stderr.close()

    def stderr_tail(self, limit: int = 3000) -> str:
        try:
            return self.stderr_path.read_text("utf-8", "replace")[-limit:]
        except OSError:
            return ""


@contextlib.contextmanager
def workers_cleanup() -> Iterator[list[Worker]]:
    """A list to put workers in; each is killed and reaped on the way out, whatever
    happened."""
    made: list[Worker] = []
    try:
        yield made
    finally:
        for worker in made:
            worker.kill()


# --- database reads (the checker's own SQL, independent of the store) ------------------------


def start_together(workers: Sequence[Worker], ready_timeout: float = 60) -> None:
    """Wait until every worker is ready, then release them all at once, so that they
    contend at about the same instant."""
    for worker in workers:
        worker.wait_for("READY", ready_timeout)
    for worker in workers:
        worker.send("GO")


def recorded_history(conn: psycopg.Connection[Any], prefix: str, paths: Iterable[Path]
                     ) -> tuple[list[OpRecord], list[AuditRow], list[FinalRow],
                                list[Violation]]:
    """The operations the workers recorded, the tenant's audit log and final rows, and what
    the history checker says of them together."""
    records = read_records(paths)
    audit = audit_rows(conn, prefix)
    finals = final_rows(conn, prefix)
    return records, audit, finals, check_history(records, audit, final_rows=finals)


# The runs' tables are in the default schema, named: a connection's search_path is not
# trusted to find them (scenario 18).
def audit_rows(conn: psycopg.Connection[Any], prefix: str) -> list[AuditRow]:
    rows = conn.execute(
        "SELECT seq, event_id, event, outcome, reason, tenant_id, logical_agent_id, "
        "binding_id, connector_id, epoch, correlation_id, recorded_at "
        "FROM mos_lease.connector_lease_audit_log WHERE starts_with(tenant_id, %s) ORDER BY seq",
        (prefix,)).fetchall()
    return [AuditRow(seq=r[0], event_id=str(r[1]), event=r[2], outcome=r[3], reason=r[4],
                     identity=(r[5], r[6], r[7]), connector_id=r[8], epoch=r[9],
                     correlation_id=r[10], recorded_at=r[11]) for r in rows]


def audit_rows_of(conn: psycopg.Connection[Any], identities: Iterable[Ident]) -> list[AuditRow]:
    """The audit rows of exactly these identities (for runs that also use identities outside
    their prefix, such as fuzzed ones)."""
    # Text with NUL bytes cannot be stored, so no row can have it.
    ids = sorted({i for i in identities if "\x00" not in "".join(i)})
    rows = conn.execute(
        "SELECT a.seq, a.event_id, a.event, a.outcome, a.reason, a.tenant_id, "
        "a.logical_agent_id, a.binding_id, a.connector_id, a.epoch, a.correlation_id, "
        "a.recorded_at FROM mos_lease.connector_lease_audit_log AS a "
        "JOIN unnest(%s::text[], %s::text[], %s::text[]) AS i(t, g, b) "
        "ON a.tenant_id = i.t AND a.logical_agent_id = i.g AND a.binding_id = i.b "
        "ORDER BY a.seq",
        ([i[0] for i in ids], [i[1] for i in ids], [i[2] for i in ids])).fetchall()
    return [AuditRow(seq=r[0], event_id=str(r[1]), event=r[2], outcome=r[3], reason=r[4],
                     identity=(r[5], r[6], r[7]), connector_id=r[8], epoch=r[9],
                     correlation_id=r[10], recorded_at=r[11]) for r in rows]


def final_rows(conn: psycopg.Connection[Any], prefix: str) -> list[FinalRow]:
    rows = conn.execute(
        "SELECT tenant_id, logical_agent_id, binding_id, lease_id, epoch "
        "FROM mos_lease.logical_agent_connector_leases WHERE starts_with(tenant_id, %s)",
        (prefix,)).fetchall()
    return [FinalRow((r[0], r[1], r[2]), str(r[3]), r[4]) for r in rows]


def footprint(conn: psycopg.Connection[Any]) -> tuple[int, int, Any]:
    """(highest audit seq, lease row count, latest lease update): changes whenever anything
    is written, so equal footprints before and after a call mean it wrote nothing."""
    row = conn.execute(
        "SELECT (SELECT coalesce(max(seq), 0) FROM mos_lease.connector_lease_audit_log), "
        "(SELECT count(*) FROM mos_lease.logical_agent_connector_leases), "
        "(SELECT max(updated_at) FROM mos_lease.logical_agent_connector_leases)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), row[2]


def db_now(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def backends(conn: psycopg.Connection[Any], application_name: str) -> int:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                       (application_name,)).fetchone()
    assert row is not None
    return int(row[0])


def set_epoch(conn: psycopg.Connection[Any], identity: Ident, epoch: int) -> None:
    """Raise an identity's epoch directly (as an administrator would restore one): only
    for states the API cannot reach in test time, such as the bigint maximum. The schema
    permits only the library's transitions, so this steps around its triggers (superuser)."""
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute("UPDATE mos_lease.logical_agent_connector_leases SET epoch = %s "
                     "WHERE tenant_id = %s AND logical_agent_id = %s AND binding_id = %s",
                     (epoch, *identity))


# --- a private cluster that scenarios may stop ---------------------------------------------


class PrivateCluster:
    """A throwaway PostgreSQL cluster owned by this test: initdb into a temporary directory
    (run as ``postgres`` when we are root: PostgreSQL refuses root), fsync off, loopback only,
    on a free port. Only this cluster is ever stopped or restarted by a scenario."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        # ``env``: added to the server's environment (e.g. libfaketime's, scenario 23).
        self.env = env
        programs = server_programs()
        if isinstance(programs, str):
            raise RuntimeError(f"no PostgreSQL server programs: {programs}")
        self.programs = programs
        self.base = tempfile.mkdtemp(prefix="mos-lease-faults-pg-")
        if programs.owner is not None:
            os.chown(self.base, programs.owner.pw_uid, programs.owner.pw_gid)
        self.data = os.path.join(self.base, "data")
        self.log = os.path.join(self.base, "log")
        self.port = free_port()
        self.running = False
        self._run("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  "--no-sync")

    @property
    def dsn(self) -> str:
        return make_conninfo("", host="127.0.0.1", port=str(self.port), user="postgres",
                             dbname="postgres")

    def dsn_for(self, dbname: str) -> str:
        return make_conninfo(self.dsn, dbname=dbname)

    def _run(self, tool: str, *args: str, timeout: float = 60,
             env: Mapping[str, str] | None = None) -> None:
        self.programs.run(tool, *args, timeout=timeout, env=env)

    def start(self) -> float:
        """Start and wait until it accepts connections; returns the seconds it took."""
        began = time.monotonic()
        self._run("pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "60", "-o",
                  f"-F -p {self.port} -c listen_addresses=127.0.0.1 -k {self.base} "
                  "-c max_connections=60", "start", env=self.env)
        self.running = True
        return time.monotonic() - began

    def stop(self, mode: str = "fast") -> float:
        began = time.monotonic()
        self._run("pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "60", "stop")
        self.running = False
        return time.monotonic() - began

    def close(self) -> None:
        if self.running:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


def create_db(admin_dsn: str, name: str) -> str:
    from psycopg import sql

    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(admin_dsn, dbname=name)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# --- a network that turns hostile at a chosen moment ---------------------------------------


# The first message of a connection that only asks the server to cancel another session's
# statement (the protocol's CancelRequest code): not a session of its own.
_CANCEL_REQUEST = (80877102).to_bytes(4, "big")


class HostileFault(enum.StrEnum):
    """What :class:`HostileProxy` does once it strikes."""

    SILENT = "silent"  # nothing forwarded either way, nothing closed, from then on
    DELAY = "delay"  # every reply from then on arrives ``delay`` seconds late
    CUT_CLIENT = "cut_client"  # that connection's client side closed; the server's runs on
    CUT_SERVER = "cut_server"  # that connection's server side closed; the client hears nothing
    # Reordered closes of that connection:
    REPLY_AFTER_SERVER_CLOSE = "reply_after_server_close"  # the server's side closes while
    # the reply is held back; the reply then reaches the client ``delay`` late, then the close
    CLOSE_BEFORE_REQUEST = "close_before_request"  # the close reaches the server before the
    # pending request, which is never delivered; the client's side closes ``delay`` later
    REQUEST_AFTER_CLIENT_CLOSE = "request_after_client_close"  # the request is held until its
    # client gave up and closed, then delivered ``delay`` later: the server runs a request
    # whose sender has already moved on


@dataclass(eq=False)
class _Pair:
    client: socket.socket
    upstream: socket.socket
    first: bool = True
    fault: HostileFault | None = None  # a one-connection fault struck on this pair
    delay: float = 0.0  # that fault's delay, as armed when it struck
    keep: bool = False  # leave both sides as they are when the relay ends


class HostileProxy(PairedRelay[_Pair]):
    """A loopback relay in front of PostgreSQL that turns hostile at one chosen moment.

    :meth:`arm` names a fault and the request it strikes at: the ``at``-th message the
    clients send from then on (the opening messages of new connections included, cancel
    requests not), either ``before`` that message is forwarded or just ``after``. So the
    moment is exact relative to the call under test, whatever the machine's speed. Faults
    that describe the network (silent, delay) hold from then until :meth:`heal`; faults of a
    connection strike that connection only. :attr:`sessions` counts the connections opened
    through the proxy (cancel requests apart), which is how a caller tells which calls had to
    connect. After :meth:`heal` new connections are relayed normally, on the same address:
    a store connected through the healed proxy talks to the same server as far as it can
    tell.

    Unlike ``FaultProxy`` (faults applied when the test says so, from the test's thread),
    the strike happens in the relay's own thread, at a message of the conversation.
    """

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self._dsn = dsn
        self._fault: HostileFault | None = None
        self._at = 0
        self._after = False
        self._delay = 0.0
        self._refuse_on_strike = False
        self._refuse = False
        self._seen = 0
        self._network: HostileFault | None = None  # SILENT or DELAY once struck
        self._holding = 0
        self.sessions = 0
        self.struck_at: float | None = None  # time.monotonic() of the strike
        self.closed = False
        self._start()

    @property
    def dsn(self) -> str:
        return make_conninfo(self._dsn, host="127.0.0.1", port=str(self.port))

    def arm(self, fault: HostileFault, *, at: int = 1, after: bool = False,
            delay: float = 0.0, then_refuse: bool = False) -> None:
        """Strike with ``fault`` at the ``at``-th client message from now. ``then_refuse``:
        from the strike on, new connections are closed as soon as they open."""
        with self._lock:
            self._fault, self._at, self._after, self._delay = fault, at, after, delay
            self._refuse_on_strike = then_refuse
            self._seen, self._network, self.struck_at = 0, None, None

    @property
    def struck(self) -> bool:
        return self.struck_at is not None

    def heal(self) -> None:
        """From now on new connections and messages are relayed normally."""
        with self._lock:
            self._fault, self._network, self._refuse = None, None, False

    def settle(self, timeout: float) -> bool:
        """Wait until no request is held back any more; False if one still is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._holding == 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._network = None  # a held request goes on, so its relay thread can end
        super().close()

    # -- relaying -------------------------------------------------------------------------

    def _pair(self, client: socket.socket, upstream: socket.socket) -> _Pair:
        return _Pair(client, upstream)

    def _refusing(self) -> bool:
        return self._refuse

    def _strike(self, pair: _Pair, data: bytes) -> tuple[HostileFault | None, bool]:
        """Count a client message; (the fault striking now, whether after forwarding)."""
        with self._lock:
            if pair.first:
                pair.first = False
                if data[4:8] == _CANCEL_REQUEST:
                    return None, False
                self.sessions += 1
            if self._fault is None or self.struck_at is not None:
                return None, False
            self._seen += 1
            if self._seen < self._at:
                return None, False
            self.struck_at = time.monotonic()
            fault = self._fault
            if self._refuse_on_strike:
                self._refuse = True
            if fault in (HostileFault.SILENT, HostileFault.DELAY):
                if fault is HostileFault.DELAY or not self._after:
                    self._network = fault
            else:
                pair.fault, pair.delay = fault, self._delay
            if fault is HostileFault.SILENT:
                pair.keep = True
            return fault, self._after

    def _requests(self, pair: _Pair) -> None:
        client, upstream = pair.client, pair.upstream
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                fault, after = self._strike(pair, data)
                with self._lock:
                    silent = self._network is HostileFault.SILENT
                if silent:
                    pair.keep = True
                    continue
                if fault is HostileFault.CLOSE_BEFORE_REQUEST:
                    self._hang_up(upstream)  # the server sees the close, never the request
                    time.sleep(pair.delay)
                    self._hang_up(client)
                    return
                if fault is HostileFault.REQUEST_AFTER_CLIENT_CLOSE:
                    self._deliver_late(pair, data)
                    return
                if fault in (HostileFault.CUT_CLIENT, HostileFault.CUT_SERVER) and not after:
                    self._hang_up(client if fault is HostileFault.CUT_CLIENT else upstream)
                    pair.keep = True
                    return
                upstream.sendall(data)
                if fault is HostileFault.SILENT:
                    with self._lock:
                        self._network = HostileFault.SILENT  # the reply is never seen
                if fault in (HostileFault.CUT_CLIENT, HostileFault.CUT_SERVER):
                    self._hang_up(client if fault is HostileFault.CUT_CLIENT else upstream)
                    pair.keep = True
                    return
        self._end(pair)

    def _deliver_late(self, pair: _Pair, data: bytes) -> None:
        with self._lock:
            self._holding += 1
        try:
            held = [data]
            # Hold until the client gives up on it and closes (bounded, so a client that
            # never gives up cannot wedge the proxy), then deliver after all.
            pair.client.settimeout(10.0)
            with contextlib.suppress(OSError):
                while more := pair.client.recv(65536):
                    held.append(more)
            time.sleep(pair.delay)
            with contextlib.suppress(OSError):
                for chunk in held:
                    pair.upstream.sendall(chunk)
            time.sleep(0.05)  # let the server read the request before it sees the close
            self._hang_up(pair.client, pair.upstream)
        finally:
            with self._lock:
                self._holding -= 1

    def _replies(self, pair: _Pair) -> None:
        client, upstream = pair.client, pair.upstream
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                received = time.monotonic()
                if pair.fault is HostileFault.REPLY_AFTER_SERVER_CLOSE:
                    self._hang_up(upstream)
                    time.sleep(pair.delay)
                    client.sendall(data)
                    self._hang_up(client)
                    return
                with self._lock:
                    network, delay = self._network, self._delay
                if network is HostileFault.DELAY:
                    time.sleep(max(0.0, received + delay - time.monotonic()))
                with self._lock:
                    silent = self._network is HostileFault.SILENT
                if silent:
                    pair.keep = True
                    continue
                client.sendall(data)
        self._end(pair)

    def _end(self, pair: _Pair) -> None:
        with self._lock:
            silent = self._network is HostileFault.SILENT
        # A silent network carries no close either: the other side never hears of it.
        if not (pair.keep or silent or pair.fault is not None):
            self._hang_up(pair.client, pair.upstream)
