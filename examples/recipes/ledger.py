"""The recipes' effect table, ``recipes.effects``, and the fenced write into it.

Every piece of work a gateway serves inserts one row here through
:func:`~mos_lease_pg.effects.fenced_transaction` (or its asyncio twin): the lease row is
locked ``FOR SHARE`` and checked in the same transaction, so a row commits only while the
epoch that wrote it is current, and no row of an old epoch can follow a takeover. The
gateway role can create nothing, so :func:`set_up` creates the table once, as a superuser,
and grants the gateway role what the gateways do with it through the library's own
:func:`~mos_lease_pg.admin.roles.effect_table_grants` (what ``mos-lease roles
--effect-table`` runs).
"""

from __future__ import annotations

from typing import Any, Final

import psycopg
from psycopg_pool import ConnectionPool

from examples.recipes.config import SCOPES
from mos_lease import ConnectorExecutionContext
from mos_lease_pg.admin.roles import DEFAULT_GATEWAY_ROLE, effect_table, effect_table_grants
from mos_lease_pg.effect_batches import CoalescedEffects
from mos_lease_pg.effects import fenced_transaction

TABLE: Final = "recipes.effects"
SCHEMA: Final = """
CREATE SCHEMA IF NOT EXISTS recipes;
CREATE TABLE IF NOT EXISTS recipes.effects (
    seq              bigserial   PRIMARY KEY,
    binding_name     text        NOT NULL,
    tenant_id        text        NOT NULL,
    logical_agent_id text        NOT NULL,
    binding_id       text        NOT NULL,
    connector_id     text        NOT NULL,
    epoch            bigint      NOT NULL,
    body             text        NOT NULL,
    written_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
INSERT: Final = (
    "INSERT INTO recipes.effects (binding_name, tenant_id, logical_agent_id, binding_id, "
    "connector_id, epoch, body) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING seq")


def set_up(admin_dsn: str, gateway_role: str = DEFAULT_GATEWAY_ROLE) -> None:
    """Create ``recipes.effects`` and grant ``gateway_role`` SELECT and INSERT on it (as a
    superuser, once; run again, it changes nothing)."""
    with psycopg.connect(admin_dsn) as conn, conn.transaction():
        # Two set-ups at once could race CREATE ... IF NOT EXISTS into a unique violation.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('mos-lease recipes'))")
        conn.execute(SCHEMA)
        for statement in effect_table_grants(conn, [effect_table(TABLE)],
                                             gateway_role=gateway_role,
                                             privileges=("SELECT", "INSERT")):
            conn.execute(statement)


def _row(name: str, context: ConnectorExecutionContext, text: str) -> tuple[Any, ...]:
    identity = context.identity
    return (name, identity.tenant_id, identity.logical_agent_id, identity.binding_id,
            context.connector_id, context.epoch, text)


class LedgerAdapter:
    """A :class:`~mos_lease.adapter.ConnectorAdapter` for the threaded gateway: the request
    is the text to record; the result the row's ``seq``. It sees only the context."""

    def __init__(self, pool: ConnectionPool[Any], name: str) -> None:
        self.pool = pool
        self.name = name

    def execute(self, context: ConnectorExecutionContext, text: str, /) -> int:
        """Insert the row in a fenced transaction; raises
        :class:`~mos_lease.fencing.FencedEffectRefused` if the lease moved on."""
        with self.pool.connection() as conn, \
                fenced_transaction(conn, context, scopes=SCOPES) as cur:
            cur.execute(INSERT, _row(self.name, context, text))
            row = cur.fetchone()
        assert row is not None
        return int(row[0])


class AsyncLedgerAdapter:
    """The asyncio twin of ``LedgerAdapter``: the insert is a fenced effect of
    ``effects`` (one per process: the inserts of overlapping requests share a transaction
    and its commit, each checked against its own lease row in it)."""

    def __init__(self, effects: CoalescedEffects, name: str) -> None:
        self.effects = effects
        self.name = name

    async def execute(self, context: ConnectorExecutionContext, text: str, /) -> int:
        """As ``LedgerAdapter.execute``."""
        row = await self.effects.execute(context, INSERT, _row(self.name, context, text),
                                         scopes=SCOPES)
        assert row is not None
        return int(row[0])


class ValidateOnly:
    """The adapter of ``"work": "validate"``: the grant is validated (by ``invoke``, before
    this runs) and nothing is written; the reply's ``seq`` is ``null``."""

    def execute(self, context: ConnectorExecutionContext, text: str, /) -> None:
        """Nothing to do: validation was the work."""


class AsyncValidateOnly:
    """The asyncio twin of :class:`ValidateOnly`."""

    async def execute(self, context: ConnectorExecutionContext, text: str, /) -> None:
        """As :meth:`ValidateOnly.execute`."""
