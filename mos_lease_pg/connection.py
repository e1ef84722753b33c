"""Where the store's connections come from: one dedicated connection, or a pool.

Every connection is in autocommit mode, so each statement is its own transaction and no
session state is left behind between statements: the store works through a
transaction-pooling proxy. The timeouts travel as libpq ``options`` (``-c
statement_timeout=...``) at connect time; where a proxy refuses startup options, turn
``session_options`` off and set them on the role instead (``roles.sql`` does).

Every call is bounded in time on the client too (``ConnectionSettings.call_timeout``): a
call that has not finished by then is cancelled, its socket shut down and its connection
discarded (:mod:`mos_lease_pg.deadline`), and libpq's ``tcp_user_timeout`` and TCP
keepalives are set so that the kernel, too, gives up on a peer that stopped answering.

A dedicated connection is the fast path (no pool checkout per call: measured at
~19 µs per checkout, ~40% of a validation). It is opened on first use and replaced on the
next call after it broke, so the store recovers from a database restart by itself. Each
connection after the first is judged again against the replication the store requires
(:func:`mos_lease_pg.replication.recheck`): after a failover it is another server.
"""

from __future__ import annotations

import asyncio
import enum
import math
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from typing import Any, Final, Generic, TypeVar

import attrs
import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from mos_lease.bounded import OVERDUE, bounded
from mos_lease.clock import MonotonicClock, default_clock
from mos_lease.errors import ConfigurationError, StoreUnavailable
from mos_lease_pg import preflight, replication
from mos_lease_pg.deadline import WATCHDOG, AsyncWatch
from mos_lease_pg.finish import finish
from mos_lease_pg.statements import DEFAULT_SCHEMA, check_schema
from mos_lease_pg.translate import unavailable_on_checkout
from mos_lease_pg.wire import AsyncWire, Wire

P = TypeVar("P", psycopg_pool.ConnectionPool[Any], psycopg_pool.AsyncConnectionPool[Any])
W = TypeVar("W", Wire, AsyncWire)


def _positive_or_none(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, timedelta) or value <= timedelta(0)):
        raise ConfigurationError(f"{attr.name} must be a positive timedelta or None")


def _positive_seconds(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            or not math.isfinite(value)):
        raise ConfigurationError(f"{attr.name} must be a positive number of seconds")


def _positive_seconds_or_none(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _positive_seconds(inst, attr, value)


def _flag(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{attr.name} must be True or False")


_IDLE: Final = TransactionStatus.IDLE

# With no statement timeout, the call bound still needs one to start from.
_UNTIMED_STATEMENT: Final = timedelta(seconds=30)


@attrs.frozen(slots=True)
class ConnectionSettings:
    """How the store connects and how long it lets the server work.

    ``statement_timeout`` bounds every statement and ``lock_timeout`` every row-lock wait;
    both errors roll the statement back and surface as ``StoreUnavailable``.
    ``connect_timeout`` (seconds, libpq rounds up to at least 2) bounds opening a connection
    and ``pool_timeout`` (seconds) waiting for a pooled one. ``prepare`` uses server-side
    prepared statements (turn it off behind a proxy that cannot track them).
    ``session_options`` sends the timeouts as libpq startup options. ``schema`` is where
    the tables are (every statement names it; the session's search_path is never used).

    ``call_timeout`` (seconds) bounds every store call on the client, whatever the network
    does (a silent or half-open peer, replies that never come): by then the call has
    returned or raised. ``None`` (the default) means ``statement_timeout`` + 1 s (31 s
    without a statement timeout); see :meth:`call_bound`. A write cut off this way raises
    ``CommitOutcomeUnknown`` and is reconciled; a read raises ``StoreUnavailable``. The
    bound counts from the call: the wait for the connection (its turn on a dedicated one, or
    the pool), opening a new one (given up at the deadline, whatever ``connect_timeout``
    says) and its checks are inside it, and a validation's denial shares its read's bound.

    ``require_synchronous_replication`` refuses (``ConfigurationError``, at first use) a
    primary whose commits do not wait for a synchronous standby, and makes reconcile call a
    found write committed only once it is durable on that standby (see
    :mod:`mos_lease_pg.replication`). ``standby_reads`` lets the store run on a standby, for
    reads only (the server refuses its writes); without it a store that lands on a standby
    is refused, and a DSN naming several hosts gets ``target_session_attrs=read-write``.

    ``audit_heartbeats`` (default True: audit everything) may be turned off by a
    high-volume deployment: a successful heartbeat then writes no audit row (at 10,000
    connectors every 10 s that is 86 million rows a day less). Every denial, including a
    denied heartbeat, and every acquire, takeover, release and grant is still audited. A
    successful heartbeat's event cannot be looked up then, so reconciling one whose reply
    was lost raises ``CommitOutcomeUnknown`` (a keeper retries it: renewing again is safe)
    in the process that sent it; see ``docs/audit-retention.md``.
    """

    statement_timeout: timedelta | None = attrs.field(default=timedelta(seconds=5),
                                                      validator=_positive_or_none)
    lock_timeout: timedelta | None = attrs.field(default=timedelta(seconds=2),
                                                 validator=_positive_or_none)
    connect_timeout: float = attrs.field(default=5.0, validator=_positive_seconds)
    pool_timeout: float = attrs.field(default=2.0, validator=_positive_seconds)
    prepare: bool = True
    session_options: bool = True
    application_name: str = "mos-lease"
    schema: str = attrs.field(default=DEFAULT_SCHEMA,
                              validator=lambda _i, a, v: check_schema(v, a.name))
    call_timeout: float | None = attrs.field(default=None,
                                             validator=_positive_seconds_or_none)
    require_synchronous_replication: bool = attrs.field(default=False, validator=_flag)
    standby_reads: bool = attrs.field(default=False, validator=_flag)
    audit_heartbeats: bool = attrs.field(default=True, validator=_flag)

    def call_bound(self) -> float:
        """The client-side bound of one call, in seconds (see ``call_timeout``)."""
        if self.call_timeout is not None:
            return float(self.call_timeout)
        statement = self.statement_timeout or _UNTIMED_STATEMENT
        return statement.total_seconds() + 1.0

    def options(self) -> list[str]:
        """The ``-c name=value`` startup options these settings send."""
        if not self.session_options:
            return []
        # Timestamps arrive in the session time zone and the core works in UTC: a UTC
        # session lets psycopg hand over datetimes already in ``timezone.utc`` (no zoneinfo
        # conversion per column, a few microseconds per lease row).
        flags = ["-c TimeZone=UTC"]
        for name, value in (("statement_timeout", self.statement_timeout),
                            ("lock_timeout", self.lock_timeout)):
            if value is not None:
                millis = max(1, round(value / timedelta(milliseconds=1)))
                flags.append(f"-c {name}={millis}")
        return flags


def connect_kwargs(conninfo: str, settings: ConnectionSettings) -> dict[str, Any]:
    """Keyword arguments for ``psycopg.connect(conninfo, **kwargs)`` or a pool's ``kwargs``.

    Options already in ``conninfo`` are kept; ours are appended after them.
    """
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as bad:
        raise ConfigurationError(f"invalid PostgreSQL connection string: {bad}") from None
    # prepare_threshold=0 prepares each statement on its first use (a prepared lookup is
    # ~22% faster); None disables server-side preparation altogether.
    kwargs: dict[str, Any] = {"autocommit": True,
                              "prepare_threshold": 0 if settings.prepare else None}
    options = " ".join(filter(None, [str(given.get("options") or ""), *settings.options()]))
    if options:
        kwargs["options"] = options
    if "connect_timeout" not in given:
        kwargs["connect_timeout"] = max(2, round(settings.connect_timeout))
    if "application_name" not in given:
        kwargs["application_name"] = settings.application_name
    kwargs.update(replication.connect_attrs(given, replication.needs_of(settings)))
    # The kernel's own bounds on a peer that stopped answering: unacknowledged data is given
    # up after the call bound, and an idle connection is probed. A DSN's values win.
    bound = settings.call_bound()
    for name, value in (("tcp_user_timeout", max(1, round(bound * 1000))), ("keepalives", 1),
                        ("keepalives_idle", max(1, round(bound))),
                        ("keepalives_interval", 1), ("keepalives_count", 3)):
        if name not in given:
            kwargs[name] = value
    return kwargs


def remaining(deadline: float | None, bound: float, clock: MonotonicClock) -> float:
    """Seconds left until ``deadline`` (read on ``clock``; ``None``: a whole ``bound`` from
    now), at least 0."""
    return bound if deadline is None else max(0.0, deadline - clock())

class _Check(enum.Enum):
    """Which check a connection needs before its first statement (see :class:`_Source`)."""

    FIRST_USE = "schema check"
    RECHECK = "replication re-check"


class _Source:
    """What every connection source shares: what a connection is judged by before its first
    statement, and which connections were judged. The source's first connection gets the
    schema check (:func:`mos_lease_pg.preflight.first_use`); every later new one the
    replication re-check (:func:`mos_lease_pg.replication.recheck`): after a failover it is
    another server. Either runs within the call's deadline, like a statement (a silent
    network cuts it off, ``deadline.py``). A dedicated connection that fails its check is
    closed; a pooled one goes back to its pool."""

    def __init__(self, settings: ConnectionSettings, clock: MonotonicClock) -> None:
        self._bound = settings.call_bound()
        self._clock = clock  # the monotonic clock deadlines are read on (the store's)
        self._prepare = settings.prepare
        self._schema = settings.schema
        self._needs = replication.needs_of(settings)
        # Behind a transaction pooler only these settings work (preflight.py refuses others).
        self._pooler_safe = not (settings.prepare or settings.session_options)
        # Otherwise the first connection's check proved the startup's pid is the backend's.
        self._pid_names_backend = not self._pooler_safe
        # Set by the first connection's schema check, which runs once.
        self.schema_check: preflight.SchemaCheck | None = None
        # Connections judged so far: a pool opens new ones after a failover, on whichever
        # server is the primary then.
        self._judged: weakref.WeakSet[Any] = weakref.WeakSet()

    def _due(self, conn: object) -> _Check | None:
        """The check ``conn`` needs before its first statement, if any."""
        if self.schema_check is None:
            return _Check.FIRST_USE
        return None if conn in self._judged else _Check.RECHECK

    def _passed(self, conn: object, schema_check: preflight.SchemaCheck | None) -> None:
        if schema_check is not None:
            self.schema_check = schema_check
        self._judged.add(conn)

    def _check_deadline(self, deadline: float | None) -> float:
        return self._clock() + self._bound if deadline is None else deadline


def _vet(source: _Source, conn: psycopg.Connection[Any], deadline: float | None) -> None:
    """Judge ``conn`` as :class:`_Source` says, if it still needs it."""
    due = source._due(conn)
    if due is None:
        return
    # Watched like a statement, but not closed if the watch fired: a check that got its
    # answer passed, and the store's call then fails on the cut connection.
    watch = WATCHDOG.arm(conn, source._check_deadline(deadline), source._bound, source._clock)
    try:
        if due is _Check.FIRST_USE:
            source._passed(conn, preflight.first_use(conn, source._schema, needs=source._needs,
                                                     pooler_safe=source._pooler_safe))
        else:
            replication.recheck(conn, source._needs)
            source._passed(conn, None)
    finally:
        WATCHDOG.disarm(watch)


async def _vet_async(source: _Source, conn: psycopg.AsyncConnection[Any],
                     deadline: float | None) -> None:
    """The asyncio twin of :func:`_vet`."""
    due = source._due(conn)
    if due is None:
        return
    watch = AsyncWatch(conn, source._check_deadline(deadline), source._bound,  # see _vet
                       source._clock)
    try:
        if due is _Check.FIRST_USE:
            source._passed(conn, await preflight.first_use_async(
                conn, source._schema, needs=source._needs, pooler_safe=source._pooler_safe))
        else:
            await replication.recheck_async(conn, source._needs)
            source._passed(conn, None)
    finally:
        await watch.done()


def _mid_call(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether ``conn`` was left between a request and the end of its reply."""
    return not conn.closed and conn.info.transaction_status is not _IDLE


def discard_if_busy_sync(conn: psycopg.Connection[Any]) -> None:
    # A call interrupted by something other than a driver error (KeyboardInterrupt, a
    # cancellation) may leave its reply unread: the next call would read it as its own.
    if _mid_call(conn):
        conn.close()


async def discard_if_busy(conn: psycopg.AsyncConnection[Any]) -> None:
    """As :func:`discard_if_busy_sync`, for an asyncio connection (whose ``close`` does
    not suspend, so a second cancellation cannot stop it half way)."""
    if _mid_call(conn):
        await conn.close()


async def _give_back(pool: psycopg_pool.AsyncConnectionPool[Any],
                     conn: psycopg.AsyncConnection[Any]) -> None:
    """Return ``conn`` to ``pool`` even if the caller is cancelled meanwhile: the return
    may wait for the pool's lock, and a return cut off there would lose the connection. A
    cancellation is delivered once the connection is back (:mod:`mos_lease_pg.finish`)."""
    await finish(pool.putconn(conn))


def _no_connection(bound: float) -> StoreUnavailable:
    return StoreUnavailable(
        f"cannot connect to PostgreSQL: no connection within the {bound:g} s call bound")


def _busy(bound: float) -> StoreUnavailable:
    return StoreUnavailable(
        f"the store's connection stayed busy: no turn on it within the {bound:g} s call bound")


def make_pool(conninfo: str, settings: ConnectionSettings | None = None, *,
              min_size: int = 1, max_size: int = 4,
              **pool_options: Any) -> psycopg_pool.ConnectionPool[Any]:
    """An open ``ConnectionPool`` whose connections suit the store."""
    settings = settings if settings is not None else ConnectionSettings()
    return psycopg_pool.ConnectionPool(
        conninfo, kwargs=connect_kwargs(conninfo, settings), min_size=min_size,
        max_size=max_size, timeout=settings.pool_timeout, open=True, **pool_options)


async def open_async_pool(conninfo: str, settings: ConnectionSettings | None = None, *,
                          min_size: int = 1, max_size: int = 4,
                          **pool_options: Any) -> psycopg_pool.AsyncConnectionPool:
    """An open ``AsyncConnectionPool`` whose connections suit the store."""
    settings = settings if settings is not None else ConnectionSettings()
    pool = psycopg_pool.AsyncConnectionPool(
        conninfo, kwargs=connect_kwargs(conninfo, settings), min_size=min_size,
        max_size=max_size, timeout=settings.pool_timeout, open=False, **pool_options)
    await pool.open()
    return pool


def _check_autocommit(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    # Outside autocommit a statement would leave a transaction open (and the pool would
    # spend a second round trip committing it): refuse a pool configured that way.
    if not conn.autocommit:
        raise ConfigurationError(
            "pooled connections must be in autocommit mode: build the pool with "
            "mos_lease_pg.make_pool or pass kwargs=connect_kwargs(conninfo, settings)")


class _Checkout:
    """``checkout``, the context-manager form of a sync source's ``enter`` and ``leave``
    (for calls that are not the store's fast path)."""

    def enter(self, deadline: float | None = None) -> Wire:
        raise NotImplementedError

    def leave(self, wire: Wire) -> None:
        raise NotImplementedError

    @contextmanager
    def checkout(self, deadline: float | None = None) -> Iterator[Wire]:
        wire = self.enter(deadline)
        try:
            yield wire
        except BaseException:
            discard_if_busy_sync(wire.conn)
            raise
        finally:
            self.leave(wire)


class _AsyncCheckout:
    """As :class:`_Checkout`, for an asyncio source."""

    async def enter(self, deadline: float | None = None) -> AsyncWire:
        raise NotImplementedError

    async def leave(self, wire: AsyncWire) -> None:
        raise NotImplementedError

    @asynccontextmanager
    async def checkout(self, deadline: float | None = None) -> AsyncIterator[AsyncWire]:
        wire = await self.enter(deadline)
        try:
            yield wire
        except BaseException:
            await discard_if_busy(wire.conn)
            raise
        finally:
            await self.leave(wire)


class _Dedicated(_Source, Generic[W]):
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


class DedicatedConnection(_Checkout, _Dedicated[Wire]):
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
                    _vet(self, conn, deadline)
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
        with self._lock:
            self._closed = True
            if self._wire is not None:
                self._wire.conn.close()
                self._wire = None


class _Pooled(_Source, Generic[P]):
    """What both pooled sources share: the caller's pool and how long to wait for it."""

    def __init__(self, pool: P, settings: ConnectionSettings,
                 clock: MonotonicClock = default_clock) -> None:
        super().__init__(settings, clock)
        self._pool: P = pool
        self._timeout = settings.pool_timeout

    def _wait(self, deadline: float | None) -> float:
        # Never longer than the pool's own timeout, nor past the call's deadline.
        return min(self._timeout, remaining(deadline, self._bound, self._clock))

    def _unavailable(self, exc: psycopg.Error) -> StoreUnavailable | ConfigurationError:
        # PoolTimeout, PoolClosed, ... are psycopg errors too.
        return unavailable_on_checkout(exc, pool_timeout=self._timeout)


class PooledConnection(_Checkout, _Pooled[psycopg_pool.ConnectionPool[Any]]):
    """Connections checked out of a caller-owned ``ConnectionPool`` for one call each."""

    def enter(self, deadline: float | None = None) -> Wire:
        """A connection of the pool for one call (:meth:`leave` gives it back)."""
        try:
            conn = self._pool.getconn(timeout=self._wait(deadline))
        except psycopg.Error as exc:
            raise self._unavailable(exc) from exc
        try:
            _check_autocommit(conn)
            _vet(self, conn, deadline)
            return Wire(conn, prepare=self._prepare, pid_names_backend=self._pid_names_backend,
                        clock=self._clock)
        except BaseException:
            self._pool.putconn(conn)
            raise

    def leave(self, wire: Wire) -> None:
        # The pool replaces a connection that comes back broken.
        self._pool.putconn(wire.conn)

    def close(self) -> None:
        """The pool belongs to the caller, who closes it."""


class AsyncDedicatedConnection(_AsyncCheckout, _Dedicated[AsyncWire]):
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
                    await _vet_async(self, conn, deadline)
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

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            if self._wire is not None:
                await self._wire.conn.close()
                self._wire = None


class AsyncPooledConnection(_AsyncCheckout, _Pooled[psycopg_pool.AsyncConnectionPool[Any]]):
    """The asyncio twin of :class:`PooledConnection`."""

    async def enter(self, deadline: float | None = None) -> AsyncWire:
        """As :meth:`PooledConnection.enter`."""
        task = asyncio.current_task()
        asked = 0 if task is None else task.cancelling()
        try:
            conn = await self._pool.getconn(timeout=self._wait(deadline))
        except psycopg.Error as exc:
            raise self._unavailable(exc) from exc
        if task is not None and task.cancelling() > asked:
            # The pool waits for a connection with asyncio.wait_for, which on 3.11 returns
            # the connection it just got and drops a cancellation arriving at that moment;
            # a cancellation that came in during the wait and was not delivered is
            # delivered here, after the connection went back.
            await _give_back(self._pool, conn)
            raise asyncio.CancelledError
        try:
            _check_autocommit(conn)
            await _vet_async(self, conn, deadline)
            return AsyncWire(conn, prepare=self._prepare,
                             pid_names_backend=self._pid_names_backend)
        except BaseException:
            await _give_back(self._pool, conn)
            raise

    async def leave(self, wire: AsyncWire) -> None:
        await _give_back(self._pool, wire.conn)

    async def close(self) -> None:
        """The pool belongs to the caller, who closes it."""
