"""The store's own connection: :class:`DedicatedConnection` and its asyncio twin, opened on
first use within the call's deadline and replaced on the next call after it broke; callers
take turns on it, one call at a time.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any, Generic, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict

from mos_lease.bounded import OVERDUE, bounded
from mos_lease.clock import MonotonicClock, default_clock
from mos_lease.errors import StoreUnavailable
from mos_lease_pg.connection.settings import ConnectionSettings, connect_kwargs
from mos_lease_pg.connection.source import (
    AsyncCheckout,
    Checkout,
    Source,
    remaining,
    vet,
    vet_async,
)
from mos_lease_pg.translate import unavailable_on_checkout
from mos_lease_pg.wire import AsyncWire, Wire

W = TypeVar("W", Wire, AsyncWire)


def _no_connection(bound: float) -> StoreUnavailable:
    return StoreUnavailable(
        f"cannot connect to PostgreSQL: no connection within the {bound:g} s call bound")


def _busy(bound: float) -> StoreUnavailable:
    return StoreUnavailable(
        f"the store's connection stayed busy: no turn on it within the {bound:g} s call bound")


class _Dedicated(Source, Generic[W]):
    """What both dedicated connections share: how to connect, and the current connection's
    sender (whose ``conn`` is the connection itself)."""

    def __init__(self, conninfo: str, settings: ConnectionSettings,
                 clock: MonotonicClock = default_clock) -> None:
        super().__init__(settings, clock)
        self._conninfo = conninfo
        self._kwargs = connect_kwargs(conninfo, settings)
        self._given = conninfo_to_dict(conninfo)  # valid: connect_kwargs parsed it
        self._wire: W | None = None
        self._closed = False

    def _usable(self) -> W | None:
        """The current sender if its connection is still open (a broken one is closed)."""
        wire = self._wire
        return wire if wire is not None and not wire.closed else None

    def _connect_kwargs(self, deadline: float | None) -> dict[str, Any]:
        # Opening a connection counts against the call's deadline too. libpq waits at least
        # 2 s, so the connect is also given up from outside at the deadline (_connect, and
        # asyncio.timeout in the asyncio twin); this only ends an abandoned attempt sooner.
        if deadline is None or "connect_timeout" in self._given:
            return self._kwargs
        left = math.ceil(min(self._kwargs["connect_timeout"],
                             remaining(deadline, self._bound, self._clock)))
        return {**self._kwargs, "connect_timeout": max(2, left)}

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise StoreUnavailable("the store is closed")


class DedicatedConnection(Checkout, _Dedicated[Wire]):
    """One connection, opened on first use and replaced after it broke."""

    def __init__(self, conninfo: str, settings: ConnectionSettings,
                 clock: MonotonicClock = default_clock) -> None:
        super().__init__(conninfo, settings, clock)
        self._lock = threading.Lock()
        # Held for a whole call: psycopg serializes single statements on a connection, but
        # another thread's statement would take the shared cursor between a statement and
        # the reading of its rows.
        self._in_use = threading.Lock()

    def _current(self, deadline: float | None = None) -> Wire:
        wire = self._usable()
        if wire is not None:
            return wire
        with self._lock:
            self._refuse_if_closed()
            wire = self._usable()
            if wire is None:
                if self._wire is not None:
                    self._wire.conn.close()
                    self._wire = None
                conn = self._connect(deadline)
                try:
                    vet(self, conn, deadline)
                except BaseException:
                    conn.close()
                    raise
                wire = self._wire = Wire(conn, prepare=self._prepare,
                                         pid_names_backend=self._pid_names_backend,
                                         clock=self._clock)
            return wire

    def _connect(self, deadline: float | None) -> psycopg.Connection[Any]:
        """A new connection, within the call's deadline. libpq's ``connect_timeout`` is
        whole seconds, at least 2, per address tried, so the connect runs on a thread of
        its own and is given up at the deadline (a connection it opens later is closed)."""
        kwargs = self._connect_kwargs(deadline)
        opened = bounded(lambda: psycopg.Connection.connect(self._conninfo, **kwargs),
                         remaining(deadline, self._bound, self._clock),
                         name="mos-lease-connect",
                         late=lambda conn: conn.close())
        if opened is OVERDUE:
            raise _no_connection(self._bound)
        if isinstance(opened, psycopg.Error):
            raise unavailable_on_checkout(opened, pool_timeout=0) from opened
        if isinstance(opened, BaseException):
            raise opened
        return opened

    def enter(self, deadline: float | None = None) -> Wire:
        """Take the connection for one call (:meth:`leave` gives it back): the store's fast
        path, with no context-manager generator around it."""
        in_use = self._in_use
        # A call stuck on the connection holds this lock only until its own deadline.
        if not in_use.acquire(blocking=False) and not in_use.acquire(
                timeout=remaining(deadline, self._bound, self._clock)):
            raise _busy(self._bound)
        try:
            wire = self._wire
            return wire if wire is not None and not wire.conn.closed else self._current(deadline)
        except BaseException:
            in_use.release()
            raise

    def leave(self, wire: Wire) -> None:
        self._in_use.release()

    def close(self) -> None:
        # A call another thread is making (one a caller gave up on, say) keeps the
        # connection until it ends, which its own bound guarantees: closing a libpq
        # connection under a statement in flight is undefined behaviour, and a process
        # abort was seen. So the close waits for the call, at most one call bound.
        taken = self._in_use.acquire(timeout=self._bound)
        try:
            with self._lock:
                self._closed = True
                if self._wire is not None:
                    self._wire.conn.close()
                    self._wire = None
        finally:
            if taken:
                self._in_use.release()


class AsyncDedicatedConnection(AsyncCheckout, _Dedicated[AsyncWire]):
    """The asyncio twin of :class:`DedicatedConnection`."""

    def __init__(self, conninfo: str, settings: ConnectionSettings,
                 clock: MonotonicClock = default_clock) -> None:
        super().__init__(conninfo, settings, clock)
        self._lock = asyncio.Lock()
        self._in_use = asyncio.Lock()  # see DedicatedConnection

    async def _current(self, deadline: float | None = None
                       ) -> AsyncWire:
        wire = self._usable()
        if wire is not None:
            return wire
        async with self._lock:
            self._refuse_if_closed()
            wire = self._usable()
            if wire is None:
                if self._wire is not None:
                    await self._wire.conn.close()
                    self._wire = None
                # Bounded by the deadline here, not by libpq's connect_timeout (see
                # DedicatedConnection._connect); asyncio.timeout lets a cancellation through.
                try:
                    async with asyncio.timeout(remaining(deadline, self._bound, self._clock)):
                        conn = await psycopg.AsyncConnection.connect(
                            self._conninfo, **self._connect_kwargs(deadline))
                except TimeoutError:
                    raise _no_connection(self._bound) from None
                except psycopg.Error as exc:
                    raise unavailable_on_checkout(exc, pool_timeout=0) from exc
                try:
                    await vet_async(self, conn, deadline)
                except BaseException:
                    await conn.close()
                    raise
                wire = self._wire = AsyncWire(conn, prepare=self._prepare,
                                              pid_names_backend=self._pid_names_backend)
            return wire

    async def enter(self, deadline: float | None = None) -> AsyncWire:
        """As :meth:`DedicatedConnection.enter`."""
        in_use = self._in_use
        if in_use.locked():
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns the lock it just
            # obtained and drops a cancellation that arrives at that moment.
            try:
                async with asyncio.timeout(remaining(deadline, self._bound, self._clock)):
                    await in_use.acquire()
            except TimeoutError:
                raise _busy(self._bound) from None
        else:
            await in_use.acquire()  # free and nobody waiting: taken without suspending
        try:
            wire = self._wire
            return (wire if wire is not None and not wire.conn.closed
                    else await self._current(deadline))
        except BaseException:
            in_use.release()
            raise

    async def leave(self, wire: AsyncWire) -> None:
        self._in_use.release()

    def taken(self) -> bool:
        return self._in_use.locked()

    async def free(self) -> None:
        in_use = self._in_use
        if in_use.locked():  # its turn, given back at once (the lock wakes in order)
            await in_use.acquire()
            in_use.release()
            await asyncio.sleep(0)

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            if self._wire is not None:
                await self._wire.conn.close()
                self._wire = None
