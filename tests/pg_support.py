"""Finding a PostgreSQL server for the tests, and making throwaway databases on it.

Discovery order:

1. ``MOS_LEASE_TEST_DSN``, if set (and then nothing else: an explicit setting that does not
   work is an error, not a reason to test against something else);
2. a trust-auth server on 127.0.0.1:5432;
3. testcontainers, only if a Docker socket file exists and the engine answers a ping
   (``testcontainers`` is imported only then and is not a dependency);
4. a throwaway cluster from the installed ``initdb``/``pg_ctl`` under
   ``/usr/lib/postgresql/*/bin``, run as the ``postgres`` user when we are root (PostgreSQL
   refuses to run as root), with fsync off;
5. otherwise :func:`find_server` returns a message naming what to install or set.

Every test run creates its own database on the server found and drops it at the end.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import multiprocessing.process
import os
import pwd
import queue
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse
from uuid import UUID

import attrs
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ENV_DSN = "MOS_LEASE_TEST_DSN"
ENV_REQUIRE = "MOS_LEASE_REQUIRE_PG"
LOCAL_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"

HOW_TO_GET_ONE = (
    "No PostgreSQL server for the tests. Do one of: set MOS_LEASE_TEST_DSN to a "
    "postgresql:// URL of a role that may CREATE DATABASE; run a trust-auth server on "
    "127.0.0.1:5432 (Debian: apt-get install postgresql, then pg_ctlcluster 15 main start); "
    "install Docker and `pip install testcontainers[postgres]`; or install the PostgreSQL "
    "server binaries (apt-get install postgresql) so initdb/pg_ctl are under "
    "/usr/lib/postgresql/*/bin."
)


def _nothing() -> None:
    return None


@attrs.frozen(slots=True)
class PgServer:
    """A server the tests may use. ``dsn`` connects with rights to create databases."""

    dsn: str
    how: str
    stop: Callable[[], None] = _nothing


def require_pg() -> bool:
    """CI sets ``MOS_LEASE_REQUIRE_PG=1``: then a missing server fails instead of skipping."""
    return os.environ.get(ENV_REQUIRE, "") not in ("", "0")


def answers(dsn: str, timeout: int = 2) -> str | None:
    """``None`` if ``dsn`` accepts a connection and a query, else why not."""
    try:
        with psycopg.connect(dsn, connect_timeout=timeout, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc).strip() or type(exc).__name__
    return None


# --- Docker ----------------------------------------------------------------------------------


def _docker_socket() -> str | None:
    host = os.environ.get("DOCKER_HOST", "")
    path = urlparse(host).path if host.startswith("unix://") else "/var/run/docker.sock"
    return path if os.path.exists(path) else None


def _docker_answers(path: str) -> bool:
    # Checked by hand before testcontainers is imported: without an engine it fails late and
    # can leave a socket open, which -W error turns into a test failure.
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(path)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b"OK" in sock.recv(4096)
    except OSError:
        return False


def _from_testcontainers() -> PgServer | None:
    path = _docker_socket()
    if path is None or not _docker_answers(path):
        return None
    try:
        # Newer testcontainers deprecate the short path in favour of the community one.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                from testcontainers.community.postgres import PostgresContainer
            except ImportError:
                from testcontainers.postgres import PostgresContainer
    except ImportError:
        return None
    container: Any = PostgresContainer("postgres:16-alpine", driver=None)
    try:
        container.start()
    except Exception:  # the engine answered a ping but cannot run the container
        with contextlib.suppress(Exception):
            container.stop()
        return None
    return PgServer(str(container.get_connection_url()), "testcontainers", container.stop)


# --- initdb ----------------------------------------------------------------------------------


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _from_initdb() -> PgServer | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    if not found:
        return None
    bindir = os.path.dirname(found[-1])
    user: str | None = None
    if os.geteuid() == 0:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            return None
        user = "postgres"
    base = tempfile.mkdtemp(prefix="mos-lease-pg-")
    if user is not None:
        os.chown(base, account.pw_uid, account.pw_gid)
    data, port = os.path.join(base, "data"), _free_port()

    def run(*args: str) -> None:
        subprocess.run(args, user=user, check=True, capture_output=True, timeout=120)

    def stop() -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            run(f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)

    try:
        run(f"{bindir}/initdb", "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8",
            "--no-sync")
        run(f"{bindir}/pg_ctl", "-D", data, "-l", os.path.join(base, "log"), "-w", "-o",
            f"-F -p {port} -c listen_addresses=127.0.0.1 -k {base}", "start")
    except (subprocess.SubprocessError, OSError):
        stop()
        return None
    return PgServer(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", "initdb", stop)


def find_server() -> PgServer | str:
    """The first server found in the documented order, or a message saying what to do."""
    explicit = os.environ.get(ENV_DSN)
    if explicit:
        problem = answers(explicit, timeout=5)
        if problem is None:
            return PgServer(explicit, ENV_DSN)
        return f"{ENV_DSN} is set but the server does not answer: {problem}"
    if answers(LOCAL_DSN) is None:
        return PgServer(LOCAL_DSN, "127.0.0.1:5432")
    for start in (_from_testcontainers, _from_initdb):
        server = start()
        if server is not None:
            return server
    return HOW_TO_GET_ONE


# --- databases and schemas -------------------------------------------------------------------


def with_params(dsn: str, **params: Any) -> str:
    """``dsn`` with some connection parameters replaced."""
    return make_conninfo(dsn, **params)


def in_schema(dsn: str, schema: str) -> str:
    """``dsn`` whose sessions use ``schema`` (only) as their search_path. The library never
    depends on a search_path (stores and ``migrate`` name their schema); tests use this to
    connect with a misleading one."""
    return make_conninfo(dsn, options=f"-c search_path={schema}")


def unique_name(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"


def create_database(server_dsn: str, name: str) -> str:
    """Create database ``name`` on the server and return a DSN for it."""
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(server_dsn, dbname=name)


def drop_database(server_dsn: str, name: str) -> None:
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                     .format(sql.Identifier(name)))


# --- a proxy that loses connections on purpose ----------------------------------------------


class LoopbackRelay:
    """A TCP listener on 127.0.0.1 in front of the server: every client connection gets an
    upstream connection of its own, and both sockets go to :meth:`_relay`, which subclasses
    write. ``dsn`` is the server's; :attr:`port` is where clients connect instead."""

    def __init__(self, dsn: str) -> None:
        params = conninfo_to_dict(dsn)
        host, port = params.get("host") or "127.0.0.1", params.get("port") or 5432
        self._target = (str(host), int(str(port)))
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self._listener.settimeout(0.05)
        self.port: int = self._listener.getsockname()[1]

    def _start(self) -> None:
        """Begin accepting (called by a subclass once its own state is set up)."""
        self._spawn(self._accept_loop)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.settimeout(None)
                # Messages may be relayed one by one: without this, Nagle's algorithm and
                # delayed ACKs add ~40 ms to every round trip.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._relay(client, upstream)

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        raise NotImplementedError

    def _stop_accepting(self) -> None:
        self._stopping.set()
        self._listener.close()

    def _join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=5)

    @staticmethod
    def _hang_up(*socks: socket.socket) -> None:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class FaultProxy(LoopbackRelay):
    """A proxy that loses connections on demand.

    * :meth:`cut_reply_to`: the next request containing ``marker`` reaches the server, but
      its reply is thrown away and both sides are closed: the statement ran (and committed)
      and the client never hears of it.
    * :meth:`cut_request`: the next request containing ``marker`` is thrown away and both
      sides are closed: the statement never reached the server.
    * :meth:`refuse`: every connection is closed and new ones are refused.
    * :meth:`go_silent`: nothing is forwarded any more, either way, and nothing is closed:
      a half-open network (the kernel still acknowledges, so TCP never notices).
    * :meth:`delay_replies`: every reply from the server waits that long before it is
      forwarded.
    * :meth:`cut_client` / :meth:`cut_server`: close only the client's side (the server's
      session runs on, e.g. still waiting for a lock) or only the server's (the client is
      left on a silent, open socket).

    Markers are matched against the raw protocol bytes, so the store under test must send
    statement text with every execution (``ConnectionSettings(prepare=False)``).
    """

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self._dsn = dsn
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._reply_marker: bytes | None = None
        self._request_marker: bytes | None = None
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._silent = threading.Event()
        self._reply_delay = 0.0
        self._keep: str | None = None  # after a one-sided cut: the side left open
        self._start()

    @property
    def dsn(self) -> str:
        return make_conninfo(self._dsn, host="127.0.0.1", port=str(self.port))

    def cut_reply_to(self, marker: bytes) -> None:
        with self._lock:
            self._reply_marker = marker

    def cut_request(self, marker: bytes) -> None:
        with self._lock:
            self._request_marker = marker

    def _take(self, data: bytes, which: str) -> bool:
        with self._lock:
            marker = getattr(self, which)
            if marker is not None and marker in data:
                setattr(self, which, None)
                return True
            return False

    def go_silent(self) -> None:
        self._silent.set()

    def delay_replies(self, seconds: float) -> None:
        self._reply_delay = seconds

    def cut_client(self) -> None:
        """Close every client-side socket; the server's sides stay open."""
        with self._lock:
            self._keep = "upstream"
            self._hang_up(*(client for client, _ in self._pairs))

    def cut_server(self) -> None:
        """Close every server-side socket; the clients' sides stay open (and silent)."""
        with self._lock:
            self._keep = "client"
            self._hang_up(*(upstream for _, upstream in self._pairs))

    def _end(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            keep = self._keep
        self._hang_up(*([client] if keep == "upstream" else [upstream] if keep == "client"
                        else [client, upstream]))

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            self._sockets += [client, upstream]
            self._pairs.append((client, upstream))
        lose_reply = threading.Event()
        self._spawn(self._requests, client, upstream, lose_reply)
        self._spawn(self._replies, upstream, client, lose_reply)

    def _requests(self, client: socket.socket, upstream: socket.socket,
                  lose_reply: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self._silent.is_set():
                    continue
                if self._take(data, "_request_marker"):
                    break
                if self._take(data, "_reply_marker"):
                    lose_reply.set()
                upstream.sendall(data)
        self._end(client, upstream)

    def _replies(self, upstream: socket.socket, client: socket.socket,
                 lose_reply: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if lose_reply.is_set():
                    break
                if self._reply_delay:
                    time.sleep(self._reply_delay)
                if self._silent.is_set():
                    continue
                client.sendall(data)
        self._end(client, upstream)

    def refuse(self) -> None:
        """Close every connection and stop accepting new ones."""
        self._stop_accepting()
        with self._lock:
            self._keep = None
            self._hang_up(*self._sockets)

    def close(self) -> None:
        self.refuse()
        self._join()
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()


# --- processes that each report once ---------------------------------------------------------


def gather(workers: Sequence[multiprocessing.process.BaseProcess], results: Any,
           timeout: float) -> list[Any]:
    """Start ``workers``, take one report from each off the ``results`` queue, and always
    reap them (killing any still alive after 30 s). Raises ``TimeoutError`` when a report
    is ``timeout`` seconds late."""
    for process in workers:
        process.start()
    reports: list[Any] = []
    try:
        for _ in workers:
            reports.append(results.get(timeout=timeout))
    except queue.Empty:
        raise TimeoutError(f"only {len(reports)} of {len(workers)} processes reported"
                           ) from None
    finally:
        for process in workers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        results.join_thread()
    return reports


# --- deterministic ids ------------------------------------------------------------------------


class CountingIds:
    """An id source of distinct, reproducible UUIDs: a 64-bit namespace and a counter.

    Two sources with the same namespace hand out the same sequence, which is how two stores
    are driven through identical operations.
    """

    def __init__(self, namespace: int | None = None) -> None:
        self.namespace = secrets.randbits(63) if namespace is None else namespace
        self._count = itertools.count(1)

    def __call__(self) -> UUID:
        return UUID(int=(self.namespace << 64) | next(self._count))
