"""What the failover tests share: stores on a replicated pair, and a cancel at the right time."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.admin import migrate
from tests.failover.cluster import ReplicatedPair
from tests.pg_support import ServerPrograms, require_pg, server_programs, unique_name

CALL_TIMEOUT = 2.0


def cluster_programs() -> ServerPrograms:
    """The server programs the clusters run on (the installed ones, else the wheel's); skips
    (or fails where PostgreSQL is required) without any."""
    found = server_programs()
    if isinstance(found, str):
        problem = f"no PostgreSQL server programs for the failover clusters: {found}"
        if require_pg():
            pytest.fail(f"MOS_LEASE_REQUIRE_PG is set and {problem}", pytrace=False)
        pytest.skip(problem)
    return found


def ha_settings(**overrides: Any) -> ConnectionSettings:
    """Short bounds (a 2 s call bound), synchronous replication required."""
    fields: dict[str, Any] = {
        "statement_timeout": timedelta(seconds=1), "lock_timeout": timedelta(seconds=1),
        "connect_timeout": 2.0, "call_timeout": CALL_TIMEOUT,
        "require_synchronous_replication": True, "application_name": "failover-store"}
    fields.update(overrides)
    return ConnectionSettings(**fields)


def migrated(pair: ReplicatedPair) -> str:
    """A new migrated database on the pair; its multi-host DSN."""
    dsn = pair.create_database(unique_name("fo"))
    migrate(dsn)
    return dsn


def store(dsn: str, **overrides: Any) -> PostgresLeaseStore:
    return PostgresLeaseStore(dsn, settings=ha_settings(**overrides))


class CancelWhenWaiting:
    """A thread that waits until some backend of ``application_name`` waits for its
    synchronous standby (``wait_event = 'SyncRep'``) and cancels it, as an operator or a
    pooler's timeout would."""

    def __init__(self, admin_dsn: str, application_name: str, timeout: float = 20) -> None:
        self.cancelled: list[int] = []
        self.error: BaseException | None = None
        self._dsn = admin_dsn
        self._app = application_name
        self._timeout = timeout
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with psycopg.connect(self._dsn, autocommit=True) as conn:
                deadline = time.monotonic() + self._timeout
                while time.monotonic() < deadline:
                    row = conn.execute(
                        "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                        "AND wait_event = 'SyncRep'", (self._app,)).fetchone()
                    if row is not None:
                        conn.execute("SELECT pg_cancel_backend(%s)", (row[0],))
                        self.cancelled.append(int(row[0]))
                        return
                    time.sleep(0.01)
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self) -> list[int]:
        self._thread.join(timeout=self._timeout + 5)
        if self.error is not None:
            raise self.error
        return self.cancelled
