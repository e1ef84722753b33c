"""The database clock the fault workers record by: ``clock_timestamp()`` on a connection of
its own, estimated from the host's monotonic clock while the server is down."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import Any

import psycopg

from mos_lease import StoreUnavailable
from tests.faults import clockskew


class DbClock:
    """``clock_timestamp()`` on a connection of its own (never the store's, so the clock
    keeps working while a scenario breaks the store's connection).

    While the server is down the time is estimated from the host's monotonic clock and the
    last offset measured (same host, so the estimate is good to a few milliseconds); such
    readings are flagged ``estimated``.
    """

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: psycopg.Connection[Any] | None = None
        self._offset: float | None = None  # database epoch seconds - real monotonic
        self._retry_at = 0.0
        self.estimated = False

    def now(self) -> datetime:
        mono = clockskew.real_monotonic()
        if mono >= self._retry_at:
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._close()
                    self._conn = psycopg.connect(self._dsn, autocommit=True,
                                                 connect_timeout=2,
                                                 application_name="faults-clock")
                row = self._conn.execute("SELECT clock_timestamp()", prepare=True).fetchone()
                assert row is not None
                value: datetime = row[0].astimezone(UTC)
                after = clockskew.real_monotonic()
                self._offset = value.timestamp() - (mono + after) / 2
                self.estimated = False
                return value
            except psycopg.Error:
                self._close()
                self._retry_at = clockskew.real_monotonic() + 0.05
        if self._offset is None:
            raise StoreUnavailable("database clock never read")
        self.estimated = True
        return datetime.fromtimestamp(clockskew.real_monotonic() + self._offset, UTC)

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._close()
