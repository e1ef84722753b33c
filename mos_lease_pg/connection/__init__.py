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

The package's modules: ``settings`` (:class:`ConnectionSettings` and the keyword arguments
a connection is opened with), ``source`` (what every connection source shares: the checks
a new connection passes before its first statement, and the checkout around one call),
``dedicated`` (the store's own connection) and ``pooled`` (connections of a caller's pool,
and the pools that suit the store). Every name is imported from here.
"""

from mos_lease_pg.connection.dedicated import AsyncDedicatedConnection, DedicatedConnection
from mos_lease_pg.connection.pooled import (
    AsyncPooledConnection,
    PooledConnection,
    make_pool,
    open_async_pool,
)
from mos_lease_pg.connection.settings import ConnectionSettings, connect_kwargs
from mos_lease_pg.connection.source import discard_if_busy, discard_if_busy_sync, remaining

__all__ = [
    "AsyncDedicatedConnection",
    "AsyncPooledConnection",
    "ConnectionSettings",
    "DedicatedConnection",
    "PooledConnection",
    "connect_kwargs",
    "discard_if_busy",
    "discard_if_busy_sync",
    "make_pool",
    "open_async_pool",
    "remaining",
]
