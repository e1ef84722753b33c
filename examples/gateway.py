"""A small asyncio gateway that holds a lease on PostgreSQL and writes fenced effects.

Run two of these against one database and kill the one holding the lease: the other takes
over once the lease expires, and anything the dead one's leftover work still tries is
refused at the effect boundaries. See ``examples/README.md``.

Gateways connect as the least-privileged gateway role that ``mos-lease setup`` makes
(``mos_lease_gateway``): that role can create nothing, so ``setup`` (run once, as a
superuser) creates the example's own tables in the schema ``example`` and grants the
gateway role what the example does with them.

Each gateway process:

* embeds an :class:`~mos_lease.AsyncConnectorLeaseCoordinator` on an
  :class:`~mos_lease_pg.AsyncPostgresLeaseStore`;
* holds the binding's lease with :func:`~mos_lease.hold`: it waits for the lease (taking
  it over once it has expired), keeps it renewed with heartbeats through a store (a
  connection) of their own, so a heartbeat stuck on its connection never holds up the
  validations on the other (``docs/adapters.md``, section 6), cancels the work when the
  lease is lost, and releases it on a clean stop;
* every ``--interval`` seconds issues a grant and runs :class:`LedgerAdapter` through the
  coordinator. The adapter sees only the context. It writes one ledger row in a fenced
  transaction (the lease row checked in the same transaction), then delivers a message
  carrying the signed fencing token to :class:`Mailbox`, a downstream boundary that keeps
  the highest epoch it has seen in ``connector_resource_epochs``;
* prints one JSON object per line on stdout for every step.

``--dsn`` defaults to ``$MOS_LEASE_DSN``, as for the ``mos-lease`` commands.
``replay`` is the dead gateway's leftover work: given an ``effect`` line it printed, it
tries that effect again, with the same context and token, and prints what each boundary
said.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
from collections.abc import Iterator
from datetime import datetime
from typing import Any
from uuid import UUID

import attrs
import psycopg
from psycopg import sql

from mos_lease import (
    AsyncConnectorLeaseCoordinator,
    AsyncHolder,
    ConnectorExecutionContext,
    InvalidInput,
    LeaseIdentity,
    LeaseLost,
    LeaseNotAcquired,
    StaticConnectorPolicy,
    StoreUnavailable,
    hold,
)
from mos_lease.adapter import run_adapter_async
from mos_lease.fencing import FencedEffectRefused, GuardDecision
from mos_lease.holder import HoldTiming
from mos_lease.token import format_token, parse_token
from mos_lease_pg import AsyncPostgresLeaseStore
from mos_lease_pg.admin.roles import DEFAULT_GATEWAY_ROLE
from mos_lease_pg.effects import fenced_transaction_async
from mos_lease_pg.fencing import AsyncPostgresResourceGuard

SCOPES = ("ledger:write",)
# The example's own tables, beside (not inside) the mos-lease schema. ``setup`` creates them
# as a superuser and grants the gateway role exactly what the example does with them.
SCHEMA = """
CREATE SCHEMA IF NOT EXISTS example;
CREATE TABLE IF NOT EXISTS example.ledger (
    seq          bigserial   PRIMARY KEY,
    tenant_id    text        NOT NULL,
    connector_id text        NOT NULL,
    epoch        bigint      NOT NULL,
    n            bigint      NOT NULL,
    written_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS example.mailbox (
    seq          bigserial   PRIMARY KEY,
    tenant_id    text        NOT NULL,
    connector_id text        NOT NULL,
    epoch        bigint      NOT NULL,
    body         text        NOT NULL
);
"""


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, default=str), flush=True)


GRANTS = """
GRANT USAGE ON SCHEMA example TO {role};
GRANT SELECT, INSERT ON example.ledger, example.mailbox TO {role};
GRANT USAGE ON ALL SEQUENCES IN SCHEMA example TO {role};
"""


async def setup(args: argparse.Namespace) -> int:
    """Create the example's tables (as a superuser, once) for ``--gateway-role``."""
    role = sql.Identifier(args.gateway_role)
    async with await psycopg.AsyncConnection.connect(args.dsn) as conn, conn.transaction():
        # Run twice at once, CREATE ... IF NOT EXISTS could still race into a unique
        # violation; the advisory lock makes the second wait for the first.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('mos-lease example'))")
        await conn.execute(SCHEMA)
        await conn.execute(sql.SQL(GRANTS).format(role=role))
    emit("set_up", schema="example", gateway_role=args.gateway_role)
    return 0


# --- the downstream boundary --------------------------------------------------------------


class Mailbox:
    """A boundary "elsewhere": it knows nothing about leases, only fencing tokens.

    It parses the token (refusing anything tampered with, since it shares the signing key),
    and admits it at its resource guard *in the same transaction* as the delivery, so a
    newer epoch cannot be admitted and deliver between this admission and this write.
    """

    def __init__(self, conn: psycopg.AsyncConnection[Any], key: bytes | None) -> None:
        self.conn = conn
        self.key = key
        self.guard = AsyncPostgresResourceGuard(conn)

    async def deliver(self, token_text: str, body: str) -> GuardDecision:
        token = parse_token(token_text, key=self.key)
        async with self.conn.transaction():
            decision = await self.guard.admit(f"mailbox/{token.identity}", token)
            if decision.ok:
                await self.conn.execute(
                    "INSERT INTO example.mailbox (tenant_id, connector_id, epoch, body) "
                    "VALUES (%s, %s, %s, %s)",
                    (token.identity.tenant_id, token.connector_id, token.epoch, body))
        return decision


# --- the adapter --------------------------------------------------------------------------


@attrs.frozen
class Receipt:
    ledger_seq: int
    mailbox: GuardDecision
    token: str


class LedgerAdapter:
    """An :class:`~mos_lease.adapter.AsyncConnectorAdapter` whose request is a sequence
    number. Raises :class:`FencedEffectRefused` if the lease moved on before it wrote."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], mailbox: Mailbox,
                 key: bytes | None) -> None:
        self.conn = conn
        self.mailbox = mailbox
        self.key = key

    async def execute(self, context: ConnectorExecutionContext, n: int, /) -> Receipt:
        async with fenced_transaction_async(self.conn, context, scopes=SCOPES) as cur:
            await cur.execute(
                "INSERT INTO example.ledger (tenant_id, connector_id, epoch, n) "
                "VALUES (%s, %s, %s, %s) RETURNING seq",
                (context.identity.tenant_id, context.connector_id, context.epoch, n))
            row = await cur.fetchone()
            assert row is not None
        token = format_token(context, key=self.key)
        decision = await self.mailbox.deliver(token, f"entry {n}")
        return Receipt(int(row[0]), decision, token)


def context_fields(context: ConnectorExecutionContext) -> dict[str, Any]:
    return {"tenant_id": context.identity.tenant_id,
            "logical_agent_id": context.identity.logical_agent_id,
            "binding_id": context.identity.binding_id, "connector_id": context.connector_id,
            "lease_id": str(context.lease_id), "epoch": context.epoch,
            "scopes": list(context.scopes), "expires_at": context.expires_at.isoformat(),
            "correlation_id": context.correlation_id}


def context_from(fields: dict[str, Any]) -> ConnectorExecutionContext:
    return ConnectorExecutionContext(
        LeaseIdentity(fields["tenant_id"], fields["logical_agent_id"], fields["binding_id"]),
        fields["connector_id"], UUID(fields["lease_id"]), int(fields["epoch"]),
        tuple(fields["scopes"]), datetime.fromisoformat(fields["expires_at"]),
        fields["correlation_id"])


# --- the gateway --------------------------------------------------------------------------


async def hold_and_work(args: argparse.Namespace, coordinator: AsyncConnectorLeaseCoordinator,
                        heartbeats: AsyncConnectorLeaseCoordinator, adapter: LedgerAdapter,
                        identity: LeaseIdentity, stop: asyncio.Event) -> None:
    """Get the lease, work while it is held, and start over whenever it is lost."""
    numbers = itertools.count(1)  # effect numbers run on across holds
    while not stop.is_set():
        try:
            # Waits up to a ttl, taking over an expired or released lease (never an active
            # one); the keeper's heartbeats go through ``heartbeats``. Loss cancels the block.
            async with hold(coordinator, identity, args.connector_id, scopes=SCOPES, ttl=args.ttl,
                            wait=args.ttl, heartbeat_coordinator=heartbeats, cancel_on_loss=True,
                            timing=HoldTiming(clock_step=args.clock_step)) as held:
                emit("holding", epoch=held.lease.epoch, lease_id=str(held.lease.lease_id))
                await work(args, coordinator, adapter, identity, held, stop, numbers)
        except LeaseNotAcquired as waiting:
            emit("waiting", reason=str(waiting.reason), current_epoch=waiting.epoch)
        except LeaseLost as lost:
            emit("lost", cause=str(lost.loss.cause), reason=str(lost.loss.reason))
    emit("stopped")


async def work(args: argparse.Namespace, coordinator: AsyncConnectorLeaseCoordinator,
               adapter: LedgerAdapter, identity: LeaseIdentity, held: AsyncHolder,
               stop: asyncio.Event, numbers: Iterator[int]) -> None:
    """Run an effect every ``--interval`` until stopped (or cancelled by loss)."""
    while not stop.is_set():
        try:
            grant = await held.issue_grant(scopes=SCOPES, ttl=args.ttl)
            if grant.grant is None:
                emit("grant_refused", reason=str(grant.reason))
                return
            n = next(numbers)
            outcome = await run_adapter_async(coordinator, grant.grant, adapter, n,
                                              identity=identity, scopes=SCOPES)
        except FencedEffectRefused as refused:
            emit("effect_refused", where="ledger", reason=str(refused.reason))
            continue
        except (StoreUnavailable, psycopg.OperationalError) as down:
            # The keeper keeps renewing (and gives up at its deadline); work pauses.
            emit("store_unavailable", error=str(down))
            await asyncio.sleep(args.interval)
            continue
        if outcome.value is None or outcome.context is None:
            emit("invoke_refused", reason=str(outcome.reason))
            continue
        emit("effect", n=n, epoch=outcome.context.epoch, ledger_seq=outcome.value.ledger_seq,
             mailbox=str(outcome.value.mailbox.reason or "delivered"),
             token=outcome.value.token, context=context_fields(outcome.context))
        with contextlib.suppress(TimeoutError):  # sleep, but wake at once on stop
            await asyncio.wait_for(stop.wait(), args.interval)


async def serve(args: argparse.Namespace) -> int:
    identity = LeaseIdentity(args.tenant, args.agent, args.binding)
    policy = StaticConnectorPolicy.from_dict({"rules": [{
        "tenant_id": args.tenant, "logical_agent_id": args.agent, "binding_id": args.binding,
        "connector_id": "*", "scopes": list(SCOPES), "max_lease_ttl": args.ttl,
        "max_grant_ttl": min(args.ttl, 30), "preempt_active": False}]})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Two stores, two connections: grants and validation on one, the keeper's heartbeats
    # on the other. (Grants are accepted only by the coordinator that minted them, so the
    # keeper issues them through ``coordinator`` and only renews through ``heartbeats``.)
    store = AsyncPostgresLeaseStore(args.dsn)
    keeper_store = AsyncPostgresLeaseStore(args.dsn)
    try:
        async with await psycopg.AsyncConnection.connect(args.dsn) as effects, \
                await psycopg.AsyncConnection.connect(args.dsn) as downstream:
            adapter = LedgerAdapter(effects, Mailbox(downstream, args.key), args.key)
            coordinator = AsyncConnectorLeaseCoordinator(store, policy)
            heartbeats = AsyncConnectorLeaseCoordinator(keeper_store, policy)
            emit("started", connector_id=args.connector_id, identity=str(identity))
            await hold_and_work(args, coordinator, heartbeats, adapter, identity, stop)
    finally:
        await keeper_store.aclose()
        await store.aclose()
    return 0


async def replay(args: argparse.Namespace) -> int:
    """Try an effect again exactly as the gateway that printed it would have."""
    effect = json.loads(args.effect_json)
    context = context_from(effect["context"])
    outcome: dict[str, str] = {}
    async with await psycopg.AsyncConnection.connect(args.dsn) as conn, \
            await psycopg.AsyncConnection.connect(args.dsn) as downstream:
        try:
            async with fenced_transaction_async(conn, context, scopes=SCOPES) as cur:
                await cur.execute(
                    "INSERT INTO example.ledger (tenant_id, connector_id, epoch, n) "
                    "VALUES (%s, %s, %s, %s)",
                    (context.identity.tenant_id, context.connector_id, context.epoch, -1))
            outcome["ledger"] = "written"
        except FencedEffectRefused as refused:
            outcome["ledger"] = f"refused:{refused.reason}"
        try:
            decision = await Mailbox(downstream, args.key).deliver(effect["token"], "replayed")
            outcome["mailbox"] = ("delivered" if decision.ok
                                  else f"refused:{decision.reason}")
        except InvalidInput as bad:
            outcome["mailbox"] = f"invalid:{bad.message}"
    emit("replayed", **outcome)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="An asyncio gateway holding a mos-lease lease and writing fenced effects.")
    parser.add_argument("command", choices=["serve", "replay", "setup"], nargs="?",
                        default="serve")
    default_dsn = os.environ.get("MOS_LEASE_DSN")
    parser.add_argument("--dsn", default=default_dsn, required=default_dsn is None,
                        help="libpq connection string of a database set up with `mos-lease "
                             "setup`: as the gateway role (serve, replay), as a superuser "
                             "(setup); default $MOS_LEASE_DSN")
    parser.add_argument("--gateway-role", default=DEFAULT_GATEWAY_ROLE,
                        help="for setup: the role the gateways connect as")
    parser.add_argument("--connector-id", default="example-gateway")
    parser.add_argument("--tenant", default="example")
    parser.add_argument("--agent", default="agent-1")
    parser.add_argument("--binding", default="ledger")
    parser.add_argument("--ttl", type=float, default=3.0, help="lease TTL in seconds")
    parser.add_argument("--clock-step", type=float, default=0.0,
                        help="step in database time between hosts the keeper's margin covers "
                             "(0: one database host, as in this example; 2 behind a failover "
                             "pair, which needs a ttl of 5 s or more)")
    parser.add_argument("--interval", type=float, default=0.2,
                        help="seconds between effects")
    parser.add_argument("--key-hex", default=None,
                        help="HMAC key (hex) shared with the mailbox to sign tokens")
    parser.add_argument("--effect-json", default=None, help="for replay: an effect line")
    args = parser.parse_args(argv)
    args.key = bytes.fromhex(args.key_hex) if args.key_hex else None
    if args.command == "replay" and args.effect_json is None:
        parser.error("replay needs --effect-json")
    if not 0 < args.ttl <= 300 or args.interval <= 0:
        parser.error("need 0 < --ttl <= 300 and --interval > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command = {"serve": serve, "replay": replay, "setup": setup}[args.command]
    return asyncio.run(command(args))


if __name__ == "__main__":
    sys.exit(main())

