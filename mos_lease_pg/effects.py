"""Fenced effects in the lease database: the lease check and the writes in one transaction.

::

    with fenced_transaction(conn, context) as cur:
        cur.execute("INSERT INTO outbox ...", ...)   # commits only if the lease still holds

The transaction first locks the current lease row ``FOR SHARE`` and checks it against the
context exactly as gateway validation does (:func:`mos_lease.machine.holder_refusal`: same
lease UUID, connector and epoch, not released, not expired by the database clock). Every
lease write (heartbeat, release, takeover) updates that row and so must wait for the share
lock. The result is one of two orders, never a mix:

* the effect's transaction locks first: its writes commit before any takeover can commit,
  so they belong to the old epoch's history, before the new holder starts;
* a takeover commits first: the locking read sees the new row, the check fails and
  :class:`~mos_lease.fencing.FencedEffectRefused` is raised after rolling back.

This is Temporal's pattern of fencing every persistence write with the shard's range id in
the same transaction. Keep fenced transactions short: while one is open, the holder's own
heartbeats wait for it too. A lease that expires while the transaction runs is not
re-checked at commit: the order above already keeps the successor's effects after it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from mos_lease.context import ConnectorExecutionContext
from mos_lease.errors import InvalidInput
from mos_lease.fencing import FencedEffectRefused
from mos_lease.identity import LeaseIdentity
from mos_lease.machine import holder_refusal
from mos_lease.records import LeaseRow
from mos_lease.token import FencingToken
from mos_lease.vocabulary import Reason

# The CTE is MATERIALIZED so the row lock is taken (waiting for any lease write in flight)
# before the outer SELECT reads the clock: expiry is judged at the moment the lock is held,
# not at the moment the statement started waiting for it.
LOCK_CURRENT_LEASE: Final = b"""
WITH locked AS MATERIALIZED (
    SELECT lease_id, connector_id, allowed_scopes, epoch, acquired_at, heartbeat_at,
           expires_at, released_at, updated_at
    FROM logical_agent_connector_leases
    WHERE tenant_id = %(tenant_id)s
      AND logical_agent_id = %(logical_agent_id)s
      AND binding_id = %(binding_id)s
    FOR SHARE
)
SELECT clock_timestamp(), l.lease_id, l.connector_id, l.allowed_scopes, l.epoch,
       l.acquired_at, l.heartbeat_at, l.expires_at, l.released_at, l.updated_at
FROM (SELECT 1) AS one
LEFT JOIN locked AS l ON true
"""

Fence = ConnectorExecutionContext | FencingToken
"""What an effect can be fenced by: the context an adapter received, or a token parsed
from a message (both carry identity, connector, lease UUID and epoch)."""


def _check_fence(fence: object) -> Fence:
    if not isinstance(fence, ConnectorExecutionContext | FencingToken):
        raise InvalidInput("context", "must be a ConnectorExecutionContext or FencingToken, "
                           f"not {type(fence).__name__}")
    return fence


def _params(fence: Fence) -> dict[str, str]:
    return {"tenant_id": fence.identity.tenant_id,
            "logical_agent_id": fence.identity.logical_agent_id,
            "binding_id": fence.identity.binding_id}


def judge_locked_row(fence: Fence, identity: LeaseIdentity,
                     row: tuple[Any, ...] | None) -> tuple[datetime, Reason | None]:
    """Judge the locked row (as returned by :data:`LOCK_CURRENT_LEASE`) against ``fence``."""
    assert row is not None  # the outer SELECT always yields exactly one row
    now, lease_id, connector_id, scopes, epoch, acquired, heartbeat, expires, released, \
        updated = row
    current = None if lease_id is None else LeaseRow(
        identity=identity, lease_id=lease_id, connector_id=connector_id,
        scopes=tuple(scopes), epoch=int(epoch), acquired_at=acquired, heartbeat_at=heartbeat,
        expires_at=expires, released_at=released, updated_at=updated)
    return now, holder_refusal(current, now, fence.connector_id, fence.lease_id, fence.epoch)


def _check_idle(status: TransactionStatus) -> None:
    if status != TransactionStatus.IDLE:
        # Nested in a caller's transaction, the check would be a savepoint: the caller's
        # earlier writes would commit under it without having been fenced.
        raise InvalidInput("conn", "must not be inside a transaction: a fenced transaction "
                           "begins and ends the transaction itself")


@contextmanager
def fenced_transaction(conn: psycopg.Connection[Any],
                       context: Fence) -> Iterator[psycopg.Cursor[Any]]:
    """Open a transaction on ``conn`` that holds the current lease row ``FOR SHARE`` and
    yields a cursor only if ``context`` still names the current, active lease.

    Raises :class:`~mos_lease.fencing.FencedEffectRefused` (with a lease
    :class:`~mos_lease.vocabulary.Reason`) after rolling back if it does not. The
    transaction commits when the block exits normally and rolls back if it raises. The
    caller owns the connection, so psycopg's own errors reach it unchanged.
    """
    fence = _check_fence(context)
    _check_idle(conn.info.transaction_status)
    with conn.transaction():
        with conn.cursor(row_factory=tuple_row) as check:
            check.execute(LOCK_CURRENT_LEASE, _params(fence))
            row = check.fetchone()
        _, reason = judge_locked_row(fence, fence.identity, row)
        if reason is not None:
            raise FencedEffectRefused(reason, f"{fence.identity} epoch {fence.epoch}")
        with conn.cursor() as cur:
            yield cur


@asynccontextmanager
async def fenced_transaction_async(conn: psycopg.AsyncConnection[Any],
                                   context: Fence) -> AsyncIterator[psycopg.AsyncCursor[Any]]:
    """The asyncio twin of :func:`fenced_transaction`."""
    fence = _check_fence(context)
    _check_idle(conn.info.transaction_status)
    async with conn.transaction():
        async with conn.cursor(row_factory=tuple_row) as check:
            await check.execute(LOCK_CURRENT_LEASE, _params(fence))
            row = await check.fetchone()
        _, reason = judge_locked_row(fence, fence.identity, row)
        if reason is not None:
            raise FencedEffectRefused(reason, f"{fence.identity} epoch {fence.epoch}")
        async with conn.cursor() as cur:
            yield cur
