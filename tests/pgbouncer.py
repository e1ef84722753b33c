"""A real PgBouncer in transaction mode in front of the test server (fixture ``pgbouncer``).

Each test gets its own PgBouncer: a config generated in a temporary directory, listening on a
free loopback port, forwarding every database to the server the PostgreSQL tests use, with
``default_pool_size = 2`` so that several client connections really share two server
connections (what breaks session state and prepared statements). Clients are admitted
without a password (``auth_type = trust``), and PgBouncer learns which roles exist by asking
the server as its admin role (``auth_user``), so roles a test creates work too. PgBouncer
refuses to run as root: as root it runs as the ``postgres`` user. It is stopped and its
directory removed when the test ends, also when the test fails.

Without the ``pgbouncer`` program the tests skip naming the Debian package, or fail under
``MOS_LEASE_REQUIRE_TOOLS=1`` (:mod:`tests.tools`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Final

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests import tools
from tests.ports import free_port

POOL_SIZE: Final = 2
START_SECONDS: Final = 10.0


def _config(directory: str, port: int, server: dict[str, str], admin: str,
            extra: dict[str, str]) -> str:
    host, server_port = server.get("host") or "127.0.0.1", server.get("port") or "5432"
    return "\n".join([
        "[databases]",
        f"* = host={host} port={server_port}",
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        f"listen_port = {port}",
        "unix_socket_dir =",
        "pool_mode = transaction",
        f"default_pool_size = {POOL_SIZE}",
        "max_client_conn = 200",
        "auth_type = trust",
        f"auth_file = {os.path.join(directory, 'users.txt')}",
        # Roles not in auth_file (those a test creates) are looked up on the server as the
        # admin role: with trust on both sides no password is needed.
        f"auth_user = {admin}",
        f"logfile = {os.path.join(directory, 'pgbouncer.log')}",
        *(f"{name} = {value}" for name, value in extra.items()),
        "",
    ])


class PgBouncer:
    """A running PgBouncer; :meth:`dsn` turns a DSN for the test server into one through it.
    ``extra`` adds settings to its ``[pgbouncer]`` section."""

    def __init__(self, server_dsn: str, **extra: str) -> None:
        executable = tools.which(tools.PGBOUNCER)
        assert executable is not None, "tools.need(tools.PGBOUNCER) comes first"
        server = {k: str(v) for k, v in conninfo_to_dict(server_dsn).items() if v is not None}
        admin = server.get("user") or "postgres"
        owner = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        self.directory = tempfile.mkdtemp(prefix="mos-lease-pgbouncer-")
        self._process: subprocess.Popen[bytes] | None = None
        try:
            with open(os.path.join(self.directory, "users.txt"), "w") as users:
                users.write(f'"{admin}" "{server.get("password", "")}"\n')
            if owner is not None:
                for path in (self.directory, os.path.join(self.directory, "users.txt")):
                    os.chown(path, owner.pw_uid, owner.pw_gid)
            self.port = self._start(executable, server, admin, owner, extra)
        except BaseException:
            self.stop()
            raise

    def _start(self, executable: str, server: dict[str, str], admin: str,
               owner: pwd.struct_passwd | None, extra: dict[str, str]) -> int:
        # A free port can be taken between choosing it and binding it: try a few.
        for _ in range(3):
            port = free_port()
            config = os.path.join(self.directory, "pgbouncer.ini")
            with open(config, "w") as handle:
                handle.write(_config(self.directory, port, server, admin, extra))
            self._process = subprocess.Popen(
                [executable, config], user=None if owner is None else owner.pw_name,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._listening(port):
                return port
            self._terminate()
        raise RuntimeError(f"pgbouncer did not start: {self.log_tail()}")

    def _listening(self, port: int) -> bool:
        assert self._process is not None
        until = time.monotonic() + START_SECONDS
        while time.monotonic() < until and self._process.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port),
                                                                        timeout=1):
                return True
            time.sleep(0.02)
        return False

    def dsn(self, server_dsn: str) -> str:
        """``server_dsn`` (same role and database) through this PgBouncer."""
        return make_conninfo(server_dsn, host="127.0.0.1", port=str(self.port))

    def log_tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.directory,
                                                             "pgbouncer.log")) as log:
            return " | ".join(log.read().splitlines()[-lines:])
        return "(no log)"

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def stop(self) -> None:
        self._terminate()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture
def pgbouncer(request: pytest.FixtureRequest) -> Iterator[PgBouncer]:
    """A PgBouncer in front of the run's server (skips or fails first when it is missing)."""
    tools.need(tools.PGBOUNCER)
    server: str = request.getfixturevalue("pg_server").dsn
    bouncer = PgBouncer(server)
    try:
        yield bouncer
    finally:
        bouncer.stop()
