"""Fenced effects in the lease database: the lease check and the writes in one transaction.

::

    with fenced_transaction(conn, context, scopes=["outbox:write"]) as cur:
        cur.execute("INSERT INTO outbox ...", ...)   # commits only if the lease still holds

The transaction first locks the current lease row ``FOR SHARE``, then reads the database
clock, and checks everything gateway validation checks (:func:`mos_lease.fencing.effect_refusal`):
the fence's identity (the row is the fence's own identity's, and ``identity=`` if given),
the lease UUID, connector and epoch, the lease neither released nor expired, the fence's own
``expires_at`` not passed (``grant_expired``: a context is valid only until the earlier of
its grant's and its lease's expiry, and a token made from it carries that instant), and the
``scopes`` the effect needs allowed by the current lease and, for a context, among the
context's scopes (``scope_not_authorized``). A token carries no scopes, so for a token the
needed scopes are checked against the current lease only. Every lease write (heartbeat,
release, takeover) updates that row and so must wait for the share lock. The result is one
of two orders, never a mix:

* the effect's transaction locks first: its writes commit before any takeover can commit,
  so they belong to the old epoch's history, before the new holder starts;
* a takeover commits first: the locking read sees the new row, the check fails and
  :class:`~mos_lease.fencing.FencedEffectRefused` is raised after rolling back.

This is Temporal's pattern of fencing every persistence write with the shard's range id in
the same transaction. Keep fenced transactions short: while one is open, the holder's own
heartbeats wait for it too. A lease or context that expires while the transaction runs is
not re-checked at commit: the order above already keeps the successor's effects after it.

``valid_until=ValidUntil.LEASE`` (opted into per call) judges the lease row alone and not the
fence's own ``expires_at``: for a tool that runs longer than the 30 s grant cap while its
lease is held and renewed. Every check of the row stays, so the first effect after a
takeover, a release or the lease's expiry is still refused (``docs/adapters.md``, "Tools that
outlive a grant").

A missing table and a missing privilege are configuration, not a state of the world: no
retry can help, so they are raised as :class:`~mos_lease.errors.ConfigurationError`
naming the fix (the psycopg error is its ``__cause__``), as the store raises them. For the
lease table: the ``schema=`` or the set-up; for the effect's own tables: ``mos-lease roles
--effect-table schema.table``, which grants the gateway role what fenced effects need.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from mos_lease.context import ConnectorExecutionContext
from mos_lease.errors import ConfigurationError, InvalidInput
from mos_lease.fencing import FenceCheck, ValidUntil, fence_check
from mos_lease.identity import LeaseIdentity
from mos_lease.records import LeaseRow
from mos_lease.token import FencingToken
from mos_lease.vocabulary import Reason
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, Template, statement_text

# The CTE is MATERIALIZED so the row lock is taken (waiting for any lease write in flight)
# before the outer SELECT reads the clock: expiry is judged at the moment the lock is held,
# not at the moment the statement started waiting for it.
LOCK_CURRENT_LEASE: Final = Template("lock current lease", statement_text("lock_current_lease.sql"))

Fence = ConnectorExecutionContext | FencingToken
"""What an effect can be fenced by: the context an adapter received, or a token parsed
from a message (both carry identity, connector, lease UUID, epoch and expiry; only the
context carries scopes)."""


def _params(check: FenceCheck) -> dict[str, str]:
    identity = check.token.identity
    return {"tenant_id": identity.tenant_id, "logical_agent_id": identity.logical_agent_id,
            "binding_id": identity.binding_id}


def judge_locked_row(check: FenceCheck,
                     row: tuple[Any, ...] | None) -> tuple[datetime, Reason | None]:
    """Judge the locked row (as returned by :data:`LOCK_CURRENT_LEASE`) against ``check``,
    at the database time the statement read once it held the row."""
    assert row is not None  # the outer SELECT always yields exactly one row
    now, lease_id, connector_id, scopes, epoch, acquired, heartbeat, expires, released, \
        updated = row
    current = None if lease_id is None else LeaseRow(
        identity=check.token.identity, lease_id=lease_id, connector_id=connector_id,
        scopes=tuple(scopes), epoch=int(epoch), acquired_at=acquired, heartbeat_at=heartbeat,
        expires_at=expires, released_at=released, updated_at=updated)
    return now, check.refusal(current, now)


# The object a refusal names, from the server's message (its diagnostics carry no table
# name for these): 'permission denied for table outbox', 'relation "app.outbox" does not
# exist', 'schema "app" does not exist'.
_DENIED_OBJECT = re.compile(r"permission denied for (table|sequence|schema|relation) (\S+)")
_MISSING_OBJECT = re.compile(r'(relation|schema) "([^"]+)" does not exist')
_LEASE_TABLE: Final = "logical_agent_connector_leases"
MISCONFIGURED_EFFECT_ERRORS: Final = (psycopg.errors.InsufficientPrivilege,
                                      psycopg.errors.UndefinedTable,
                                      psycopg.errors.InvalidSchemaName)
"""The psycopg errors a fenced transaction raises as :class:`ConfigurationError`."""


def misconfigured(exc: psycopg.Error, *, in_effect: bool, schema: str,
                  user: str) -> ConfigurationError:
    """The :class:`ConfigurationError` for a privilege or missing-table error ``exc`` of a
    fenced transaction: raised by the lease check (``in_effect`` false) or by a statement
    of the effect (true), on a connection of ``user``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    denied = isinstance(exc, psycopg.errors.InsufficientPrivilege)
    if not in_effect:
        if denied:
            return ConfigurationError(
                f"fenced transaction: {text}: role {user} may not read the lease table "
                f"{schema}.{_LEASE_TABLE}; connect as the gateway role `mos-lease roles` "
                "makes (mos_lease_gateway by default)")
        return ConfigurationError(
            f"fenced transaction: {text}: no lease table {schema}.{_LEASE_TABLE}; pass the "
            "schema the store uses (schema=, as ConnectionSettings.schema), or set the "
            f"database up (`mos-lease setup --schema {schema}`)")
    if denied:
        found = _DENIED_OBJECT.search(text)
        kind, name = (found[1], found[2]) if found else ("table", "TABLE")
        if kind == "schema":
            table = f"{name}.TABLE"
        elif kind == "sequence":  # a serial column's: granted with the table that owns it
            table = "SCHEMA.TABLE"
        else:  # the server names the table without its schema
            table = name if "." in name else f"SCHEMA.{name}"
        return ConfigurationError(
            f"fenced effect: {text}: role {user} may not write this {kind}; as a superuser, "
            f"`mos-lease roles --effect-table {table}` grants the gateway role what fenced "
            "effects need on an application table (USAGE on its schema, SELECT, INSERT, "
            "UPDATE, DELETE, its serial sequences; --effect-privileges to narrow)")
    found = _MISSING_OBJECT.search(text)
    name = found[2] if found else "the table"
    return ConfigurationError(
        f"fenced effect: {text}: create {name} (as its owner) before gateways write it, and "
        "name it with its schema (schema.table): a fenced transaction does not depend on "
        f"the search_path; then `mos-lease roles --effect-table schema.table`")


def _check_idle(status: TransactionStatus) -> None:
    if status != TransactionStatus.IDLE:
        # Nested in a caller's transaction, the check would be a savepoint: the caller's
        # earlier writes would commit under it without having been fenced.
        raise InvalidInput("conn", "must not be inside a transaction: a fenced transaction "
                           "begins and ends the transaction itself")


@contextmanager
def fenced_transaction(conn: psycopg.Connection[Any], context: Fence, *, scopes: Iterable[str],
                       identity: LeaseIdentity | None = None,
                       schema: str = DEFAULT_SCHEMA,
                       valid_until: ValidUntil = ValidUntil.CONTEXT,
                       ) -> Iterator[psycopg.Cursor[Any]]:
    """Open a transaction on ``conn`` that holds the current lease row ``FOR SHARE`` and
    yields a cursor only if ``context`` (a context or a token) passes every check gateway
    validation makes, judged by the database clock read once the row is locked.

    ``scopes`` (required; ``()`` for an effect that needs none) are the scopes this effect
    needs: all must be allowed by the current lease and, for a context, be among the
    context's scopes. ``identity``, if given, is the identity the effect belongs to as the
    caller knows it (for example from the route), refused like validation refuses a grant of
    another identity. ``schema`` is where the lease table is (as ``ConnectionSettings.schema``;
    the connection's search_path is not used). ``valid_until`` is the expiry that ends the
    fence (:class:`~mos_lease.fencing.ValidUntil`): the fence's own ``expires_at`` by default;
    ``ValidUntil.LEASE`` judges the current lease row alone, for a tool that outlives its
    grant while its lease is held.

    Raises :class:`~mos_lease.fencing.FencedEffectRefused` (with a lease
    :class:`~mos_lease.vocabulary.Reason`) after rolling back if any check fails. The
    transaction commits when the block exits normally and rolls back if it raises. The
    caller owns the connection, so psycopg's own errors reach it unchanged, except a
    missing privilege or table (of the lease check or of the block's statements): that
    is :class:`~mos_lease.errors.ConfigurationError` naming the fix (for an effect table,
    ``mos-lease roles --effect-table schema.table``), the psycopg error its cause.
    """
    check = fence_check(context, scopes, identity, valid_until)
    _check_idle(conn.info.transaction_status)
    in_effect = False
    try:
        with conn.transaction():
            with conn.cursor(row_factory=tuple_row) as lock:
                lock.execute(LOCK_CURRENT_LEASE.at(schema).text, _params(check))
                row = lock.fetchone()
            _, reason = judge_locked_row(check, row)
            if reason is not None:
                raise check.refused(reason)
            in_effect = True
            with conn.cursor() as cur:
                yield cur
    except MISCONFIGURED_EFFECT_ERRORS as exc:  # rolled back by now
        raise misconfigured(exc, in_effect=in_effect, schema=schema,
                            user=conn.info.user) from exc


@asynccontextmanager
async def fenced_transaction_async(conn: psycopg.AsyncConnection[Any], context: Fence, *,
                                   scopes: Iterable[str],
                                   identity: LeaseIdentity | None = None,
                                   schema: str = DEFAULT_SCHEMA,
                                   valid_until: ValidUntil = ValidUntil.CONTEXT,
                                   ) -> AsyncIterator[psycopg.AsyncCursor[Any]]:
    """The asyncio twin of :func:`fenced_transaction`."""
    check = fence_check(context, scopes, identity, valid_until)
    _check_idle(conn.info.transaction_status)
    in_effect = False
    try:
        async with conn.transaction():
            async with conn.cursor(row_factory=tuple_row) as lock:
                await lock.execute(LOCK_CURRENT_LEASE.at(schema).text, _params(check))
                row = await lock.fetchone()
            _, reason = judge_locked_row(check, row)
            if reason is not None:
                raise check.refused(reason)
            in_effect = True
            async with conn.cursor() as cur:
                yield cur
    except MISCONFIGURED_EFFECT_ERRORS as exc:  # rolled back by now
        raise misconfigured(exc, in_effect=in_effect, schema=schema,
                            user=conn.info.user) from exc
