"""PostgreSQL stores whose clock tests can move: the database clock plus an offset.

The production stores read ``clock_timestamp()`` as it is; these test doubles add an offset
to it in every statement, so a test reaches a lease's expiry without waiting. A schema must
let writes be stamped ahead of its clock for them (``pg_fixtures.allow_test_clock``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from mos_lease import ConfigurationError
from mos_lease_pg import AsyncPostgresLeaseStore, PostgresLeaseStore


class _Shifted:
    _offset: timedelta

    def _start_at(self, time_offset: object) -> None:
        if not isinstance(time_offset, timedelta):
            raise ConfigurationError("time_offset must be a timedelta")
        self._offset = time_offset

    @property
    def time_offset(self) -> timedelta:
        """Added to the database clock in every statement."""
        return self._offset

    def advance(self, by: timedelta | float) -> None:
        """Move this store's view of the database clock forward."""
        step = by if isinstance(by, timedelta) else timedelta(seconds=by)
        if step < timedelta(0):
            raise ValueError("time does not go backwards")
        self._offset += step


class ShiftedPostgresLeaseStore(_Shifted, PostgresLeaseStore):
    def __init__(self, *args: Any, time_offset: object = timedelta(0), **kwargs: Any) -> None:
        self._start_at(time_offset)
        super().__init__(*args, **kwargs)


class ShiftedAsyncPostgresLeaseStore(_Shifted, AsyncPostgresLeaseStore):
    def __init__(self, *args: Any, time_offset: object = timedelta(0), **kwargs: Any) -> None:
        self._start_at(time_offset)
        super().__init__(*args, **kwargs)
