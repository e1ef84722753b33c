"""The PostgreSQL resource guard: highest epoch per resource in ``connector_resource_epochs``.

Admission is one statement: an ``INSERT ... ON CONFLICT DO UPDATE`` whose ``WHERE`` is the
shared decision (:func:`mos_lease.fencing.admission_refusal`) written in SQL. The row lock
taken by ``ON CONFLICT`` makes decide-and-record atomic against every other admission for
the same resource, in this process or any other. Only a refusal costs a second statement,
which reads the row to *name* the reason with the shared Python function; the refusal itself
was already decided atomically, and since every refusal condition only grows over time (the
epoch only rises, a resource's identity never changes, clocks move forward), the later read
names a condition that held when the refusal was made.

Call :meth:`PostgresResourceGuard.admit` inside the transaction that performs the effect it
guards (``with conn.transaction(): guard.admit(...); <effect>``): the epoch row then stays
locked until the effect commits, so a newer epoch cannot be admitted, and act, in between.
Called outside a transaction, the admission commits on its own.

Expiry is judged by default (a token is refused from its ``expires_at``, plus an optional
``expiry_grace``) by the database's clock, which for a guard in the lease database is the
same time authority that set ``expires_at``. ``ignore_expiry=True`` turns it off.

Time is read after the lock: an admission that waited for the resource row (held by another
admission's transaction) is judged by the clock read once it holds that row, in ``ON
CONFLICT``'s ``WHERE``, which PostgreSQL evaluates after locking the conflicting row. A
token whose expiry passed while it waited is refused, so no admission is judged at a time
earlier than another session could have observed the row.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Final

import psycopg
from psycopg.rows import tuple_row

from mos_lease.errors import InternalInconsistency, MosLeaseError
from mos_lease.fencing import (
    NO_GRACE,
    GuardDecision,
    ResourceEpoch,
    admit,
    check_resource_id,
    check_token,
    judged_grace,
)
from mos_lease.identity import LeaseIdentity
from mos_lease.token import FencingToken
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, Template, statement_text
from mos_lease_pg.translate import statement_failure

# Guard and refusal: the SQL twin of ``admission_refusal`` (identity, then epoch, then
# expiry; ``not_after`` is NULL only when expiry is not judged). A refused token matches no
# row: the INSERT's SELECT yields nothing, or ON CONFLICT's WHERE is false.
#
# The INSERT's SELECT runs before the statement can wait for anything, so its clock only
# decides a resource seen for the first time. When the row exists, ON CONFLICT locks it
# (waiting for any transaction that holds it) and only then evaluates its WHERE and SET:
# expiry is judged again there, and ``updated_at`` taken there, by a clock read after the
# lock. (A clock in EXCLUDED would be the one read before the wait.)
ADMIT: Final = Template("admit", statement_text("admit.sql"))

# Read after a refusal, to name it; always one row (NULLs if the resource is unknown).
STATE: Final = Template("resource state", statement_text("resource_state.sql"))

# A refusal named as "admit" means the database changed under the guard's assumptions (a
# clock stepped back, a row edited by hand). Retry the atomic statement a few times, then
# give up loudly rather than guess.
_ATTEMPTS: Final = 3


def _params(resource_id: str, token: FencingToken,
            expiry_grace: timedelta | None) -> dict[str, Any]:
    return {
        "resource_id": resource_id, "tenant_id": token.identity.tenant_id,
        "logical_agent_id": token.identity.logical_agent_id,
        "binding_id": token.identity.binding_id, "epoch": token.epoch,
        "not_after": None if expiry_grace is None else token.expires_at + expiry_grace,
    }


def _state(row: tuple[Any, ...] | None) -> tuple[datetime, ResourceEpoch | None]:
    assert row is not None
    now, tenant, agent, binding, highest = row
    if tenant is None:
        return now, None
    return now, ResourceEpoch(LeaseIdentity(tenant, agent, binding), int(highest))


def _named(resource_id: str, token: FencingToken, expiry_grace: timedelta | None,
           row: tuple[Any, ...] | None) -> GuardDecision | None:
    """The refusal the current row explains, or ``None`` if it explains none (retry)."""
    now, current = _state(row)
    _, decision = admit(current, token, resource_id, now=now, expiry_grace=expiry_grace)
    return None if decision.ok else decision


def _failed(exc: psycopg.Error, what: str) -> MosLeaseError:
    """Any driver error as the library's: ``StoreUnavailable`` for a lost or closed
    connection (``InterfaceError`` included) or a statement the server refused,
    ``InternalInconsistency`` where the schema refused the data. A lost admission's outcome
    is not reconciled: the caller fails closed, and an admission that did commit only raised
    the resource's mark to an epoch the caller held."""
    return statement_failure(exc, what=f"resource guard {what}", write_event=None).error


def _inconsistent(resource_id: str) -> InternalInconsistency:
    return InternalInconsistency(
        f"resource {resource_id!r}: admission refused but the stored epoch explains no "
        "refusal")


class PostgresResourceGuard:
    """A durable :class:`~mos_lease.fencing.ResourceGuard` on one psycopg connection.

    The connection's database must have the mos-lease schema (``mos-lease migrate``);
    ``schema`` names it (default ``mos_lease``; the connection's search_path is not used).
    Connection failures raise :class:`~mos_lease.errors.StoreUnavailable`: a guard that
    cannot decide admits nothing. Expiry: see the module docstring (``expiry_grace`` zero
    by default, ``ignore_expiry=True`` to judge epochs only).
    """

    def __init__(self, conn: psycopg.Connection[Any], *, expiry_grace: timedelta = NO_GRACE,
                 ignore_expiry: bool = False, schema: str = DEFAULT_SCHEMA) -> None:
        self.conn = conn
        # Where the table is (as ConnectionSettings.schema); never the search_path.
        self._admit, self._state = ADMIT.at(schema).text, STATE.at(schema).text
        # ``None`` when expiry is not judged: the shared decision's spelling of "off".
        self.expiry_grace = judged_grace(expiry_grace, ignore_expiry)

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        resource_id = check_resource_id(resource_id)
        token = check_token(token)
        params = _params(resource_id, token, self.expiry_grace)
        try:
            for _ in range(_ATTEMPTS):
                with self.conn.transaction(), \
                        self.conn.cursor(row_factory=tuple_row) as cur:
                    cur.execute(self._admit, params)
                    admitted = cur.fetchone()
                    if admitted is not None:
                        return GuardDecision(resource_id, None, int(admitted[0]))
                    cur.execute(self._state, params)
                    named = _named(resource_id, token, self.expiry_grace, cur.fetchone())
                if named is not None:
                    return named
        except psycopg.Error as failed:
            raise _failed(failed, "admission") from failed
        raise _inconsistent(resource_id)

    def state(self, resource_id: str) -> ResourceEpoch | None:
        """What is stored for ``resource_id`` (for inspection and tests)."""
        resource_id = check_resource_id(resource_id)
        try:
            with self.conn.transaction(), self.conn.cursor(row_factory=tuple_row) as cur:
                cur.execute(self._state, {"resource_id": resource_id})
                return _state(cur.fetchone())[1]
        except psycopg.Error as failed:
            raise _failed(failed, "read") from failed


class AsyncPostgresResourceGuard:
    """The asyncio twin of :class:`PostgresResourceGuard`."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], *,
                 expiry_grace: timedelta = NO_GRACE, ignore_expiry: bool = False,
                 schema: str = DEFAULT_SCHEMA) -> None:
        self.conn = conn
        self._admit, self._state = ADMIT.at(schema).text, STATE.at(schema).text
        self.expiry_grace = judged_grace(expiry_grace, ignore_expiry)

    async def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        resource_id = check_resource_id(resource_id)
        token = check_token(token)
        params = _params(resource_id, token, self.expiry_grace)
        try:
            for _ in range(_ATTEMPTS):
                async with self.conn.transaction(), \
                        self.conn.cursor(row_factory=tuple_row) as cur:
                    await cur.execute(self._admit, params)
                    admitted = await cur.fetchone()
                    if admitted is not None:
                        return GuardDecision(resource_id, None, int(admitted[0]))
                    await cur.execute(self._state, params)
                    named = _named(resource_id, token, self.expiry_grace, await cur.fetchone())
                if named is not None:
                    return named
        except psycopg.Error as failed:
            raise _failed(failed, "admission") from failed
        raise _inconsistent(resource_id)

    async def state(self, resource_id: str) -> ResourceEpoch | None:
        resource_id = check_resource_id(resource_id)
        try:
            async with self.conn.transaction(), self.conn.cursor(row_factory=tuple_row) as cur:
                await cur.execute(self._state, {"resource_id": resource_id})
                return _state(await cur.fetchone())[1]
        except psycopg.Error as failed:
            raise _failed(failed, "read") from failed
