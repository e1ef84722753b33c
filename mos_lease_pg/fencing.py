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

Expiry (``expiry_grace``, off by default) is judged by the database's clock, which for a
guard in the lease database is the same time authority that set ``expires_at``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Final

import psycopg
from psycopg.rows import tuple_row

from mos_lease.errors import InternalInconsistency, StoreUnavailable
from mos_lease.fencing import (
    GuardDecision,
    ResourceEpoch,
    admit,
    check_expiry_grace,
    check_resource_id,
    check_token,
)
from mos_lease.identity import LeaseIdentity
from mos_lease.token import FencingToken

# Guard and refusal: the SQL twin of ``admission_refusal`` (identity, then epoch, then the
# optional expiry; ``not_after`` is NULL when expiry is not judged). A refused token matches
# no row: the INSERT's SELECT yields nothing, or ON CONFLICT's WHERE is false.
ADMIT: Final = b"""
INSERT INTO connector_resource_epochs AS e
    (resource_id, tenant_id, logical_agent_id, binding_id, highest_epoch, updated_at)
SELECT %(resource_id)s, %(tenant_id)s, %(logical_agent_id)s, %(binding_id)s,
       %(epoch)s::bigint, clock_timestamp()
WHERE %(not_after)s::timestamptz IS NULL OR %(not_after)s::timestamptz > clock_timestamp()
ON CONFLICT (resource_id) DO UPDATE
    SET highest_epoch = EXCLUDED.highest_epoch, updated_at = EXCLUDED.updated_at
    WHERE e.tenant_id = EXCLUDED.tenant_id
      AND e.logical_agent_id = EXCLUDED.logical_agent_id
      AND e.binding_id = EXCLUDED.binding_id
      AND e.highest_epoch <= EXCLUDED.highest_epoch
RETURNING e.highest_epoch
"""

# Read after a refusal, to name it; always one row (NULLs if the resource is unknown).
STATE: Final = b"""
SELECT clock_timestamp(), e.tenant_id, e.logical_agent_id, e.binding_id, e.highest_epoch
FROM (SELECT 1) AS one
LEFT JOIN connector_resource_epochs AS e ON e.resource_id = %(resource_id)s
"""

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


def _inconsistent(resource_id: str) -> InternalInconsistency:
    return InternalInconsistency(
        f"resource {resource_id!r}: admission refused but the stored epoch explains no "
        "refusal")


class PostgresResourceGuard:
    """A durable :class:`~mos_lease.fencing.ResourceGuard` on one psycopg connection.

    The connection's database must have the mos-lease schema (``mos-lease migrate``).
    Connection failures raise :class:`~mos_lease.errors.StoreUnavailable`: a guard that
    cannot decide admits nothing.
    """

    def __init__(self, conn: psycopg.Connection[Any], *,
                 expiry_grace: timedelta | None = None) -> None:
        self.conn = conn
        self.expiry_grace = check_expiry_grace(expiry_grace)

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        resource_id = check_resource_id(resource_id)
        token = check_token(token)
        params = _params(resource_id, token, self.expiry_grace)
        try:
            for _ in range(_ATTEMPTS):
                with self.conn.transaction(), \
                        self.conn.cursor(row_factory=tuple_row) as cur:
                    cur.execute(ADMIT, params)
                    admitted = cur.fetchone()
                    if admitted is not None:
                        return GuardDecision(resource_id, None, int(admitted[0]))
                    cur.execute(STATE, params)
                    named = _named(resource_id, token, self.expiry_grace, cur.fetchone())
                if named is not None:
                    return named
        except psycopg.OperationalError as down:
            raise StoreUnavailable(f"resource guard: {down}") from down
        raise _inconsistent(resource_id)

    def state(self, resource_id: str) -> ResourceEpoch | None:
        """What is stored for ``resource_id`` (for inspection and tests)."""
        resource_id = check_resource_id(resource_id)
        try:
            with self.conn.transaction(), self.conn.cursor(row_factory=tuple_row) as cur:
                cur.execute(STATE, {"resource_id": resource_id})
                return _state(cur.fetchone())[1]
        except psycopg.OperationalError as down:
            raise StoreUnavailable(f"resource guard: {down}") from down


class AsyncPostgresResourceGuard:
    """The asyncio twin of :class:`PostgresResourceGuard`."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], *,
                 expiry_grace: timedelta | None = None) -> None:
        self.conn = conn
        self.expiry_grace = check_expiry_grace(expiry_grace)

    async def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        resource_id = check_resource_id(resource_id)
        token = check_token(token)
        params = _params(resource_id, token, self.expiry_grace)
        try:
            for _ in range(_ATTEMPTS):
                async with self.conn.transaction(), \
                        self.conn.cursor(row_factory=tuple_row) as cur:
                    await cur.execute(ADMIT, params)
                    admitted = await cur.fetchone()
                    if admitted is not None:
                        return GuardDecision(resource_id, None, int(admitted[0]))
                    await cur.execute(STATE, params)
                    named = _named(resource_id, token, self.expiry_grace, await cur.fetchone())
                if named is not None:
                    return named
        except psycopg.OperationalError as down:
            raise StoreUnavailable(f"resource guard: {down}") from down
        raise _inconsistent(resource_id)

    async def state(self, resource_id: str) -> ResourceEpoch | None:
        resource_id = check_resource_id(resource_id)
        try:
            async with self.conn.transaction(), self.conn.cursor(row_factory=tuple_row) as cur:
                await cur.execute(STATE, {"resource_id": resource_id})
                return _state(await cur.fetchone())[1]
        except psycopg.OperationalError as down:
            raise StoreUnavailable(f"resource guard: {down}") from down
