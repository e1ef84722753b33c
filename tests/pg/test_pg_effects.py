"""The effect boundary checks everything gateway validation checks.

A fenced effect (``mos_lease_pg.effects``) and the PostgreSQL resource guard
(``mos_lease_pg.fencing``) judge the fence's own expiry, the effect's scopes and the
identity by the database clock read after they hold the row: the repros, each
refusal reason of the effect helper (sync and async), and the guard's default expiry.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

import attrs
import psycopg
import pytest
from psycopg.pq import TransactionStatus

from mos_lease import (
    AllowAllPolicy,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    MosLeaseError,
    Reason,
    StoreUnavailable,
)
from mos_lease.fencing import FencedEffectRefused, FenceReason, GuardDecision
from mos_lease.grants import ExecutionGrant
from mos_lease.token import FencingToken, format_token, parse_token
from mos_lease_pg.effects import fenced_transaction, fenced_transaction_async
from mos_lease_pg.fencing import AsyncPostgresResourceGuard, PostgresResourceGuard
from tests.pg.test_fencing import EFFECTS_TABLE, notes, tok, write_note
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

LEASE_SCOPES = ("effects:admin", "effects:write")
WRITE = ("effects:write",)

Fence = ConnectorExecutionContext | FencingToken
Verdict = Reason | FenceReason | None  # None: the effect committed
Attempt = Callable[..., Verdict]


@pytest.fixture
def effects(pg_admin: psycopg.Connection[Any]) -> str:
    pg_admin.execute(f"""CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (
        seq bigserial PRIMARY KEY, tenant_id text NOT NULL, epoch bigint NOT NULL,
        note text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())""")
    return EFFECTS_TABLE


@pytest.fixture
def ident(pg_tenant: str) -> LeaseIdentity:
    return LeaseIdentity(pg_tenant, "agent-1", "binding-1")


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn) as connection:
        yield connection


@pytest.fixture
def gateway(pg_stores: StoreFactory) -> ConnectorLeaseCoordinator:
    return ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())


@pytest.fixture(params=["sync", "async"])
def attempt(request: pytest.FixtureRequest, pg_dsn: str, effects: str) -> Attempt:
    """Run one fenced effect that writes a note, on a fresh connection, sync or async;
    return the refusal's reason, or ``None`` if the effect committed."""

    def sync(fence: Fence, scopes: Iterable[str], identity: LeaseIdentity | None = None,
             ) -> Verdict:
        with psycopg.connect(pg_dsn) as own:
            try:
                with fenced_transaction(own, fence, scopes=scopes, identity=identity) as cur:
                    write_note(cur, fence, "effect")
            except FencedEffectRefused as refused:
                assert own.info.transaction_status == TransactionStatus.IDLE  # rolled back
                return refused.reason
        return None

    async def run_async(fence: Fence, scopes: Iterable[str],
                        identity: LeaseIdentity | None) -> Verdict:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as own:
            try:
                async with fenced_transaction_async(own, fence, scopes=scopes,
                                                    identity=identity) as cur:
                    await cur.execute(f"INSERT INTO {EFFECTS_TABLE} (tenant_id, epoch, note) "
                                      "VALUES (%s, %s, %s)",
                                      (fence.identity.tenant_id, fence.epoch, "effect"))
            except FencedEffectRefused as refused:
                assert own.info.transaction_status == TransactionStatus.IDLE
                return refused.reason
        return None

    def in_loop(fence: Fence, scopes: Iterable[str], identity: LeaseIdentity | None = None,
                ) -> Verdict:
        return asyncio.run(run_async(fence, scopes, identity))

    return sync if request.param == "sync" else in_loop


def acquired(gateway: ConnectorLeaseCoordinator, identity: LeaseIdentity,
             ttl: float = 30) -> LeaseHandle:
    result = gateway.acquire(identity, "conn-a", scopes=LEASE_SCOPES, ttl=ttl)
    assert result.lease is not None, result
    return result.lease


def granted(gateway: ConnectorLeaseCoordinator, handle: LeaseHandle, ttl: float = 30,
            scopes: tuple[str, ...] = WRITE) -> tuple[ExecutionGrant, ConnectorExecutionContext]:
    grant = gateway.issue_grant(handle, scopes=scopes, ttl=ttl).grant
    assert grant is not None
    checked = gateway.validate(grant, identity=handle.identity, scopes=scopes)
    assert checked.context is not None, checked
    return grant, checked.context


def db_now(pg_admin: psycopg.Connection[Any]) -> datetime:
    row = pg_admin.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def sleep_until(pg_admin: psycopg.Connection[Any], instant: datetime) -> None:
    """Sleep until the database clock has passed ``instant``."""
    time.sleep(max(0.0, (instant - db_now(pg_admin)).total_seconds()))
    assert db_now(pg_admin) > instant


# --- the repros: a context's own expiry, and a token's ------------------------------------


def test_effect_refused_half_a_second_after_the_context_expired(
        gateway: ConnectorLeaseCoordinator, attempt: Attempt,
        pg_admin: psycopg.Connection[Any], ident: LeaseIdentity) -> None:
    """The lease is active for 30 s, the grant for 1 s: 0.5 s after ``ctx.expires_at``
    validation says ``grant_expired``, and so must the effect boundary, for the context and
    for the token made from it."""
    grant, context = granted(gateway, acquired(gateway, ident), ttl=1)
    token = parse_token(format_token(context))
    assert attempt(context, WRITE) is None and attempt(token, WRITE) is None  # not early
    sleep_until(pg_admin, context.expires_at + timedelta(seconds=0.5))
    assert gateway.validate(grant, identity=ident, scopes=WRITE).reason is \
        Reason.GRANT_EXPIRED
    assert attempt(context, WRITE) is Reason.GRANT_EXPIRED
    assert attempt(token, WRITE) is Reason.GRANT_EXPIRED
    assert notes(pg_admin, ident.tenant_id) == [(1, "effect"), (1, "effect")]


def test_effect_refused_while_the_clock_is_behind_the_lease_row(
        pg_stores: StoreFactory, attempt: Attempt, pg_admin: psycopg.Connection[Any],
        ident: LeaseIdentity) -> None:
    """The lease row is stamped by a store a minute ahead of the database clock, which, to
    the effect boundary reading that clock, is a clock that stepped back since: the lease
    looks active, but no effect is judged at a time before the row's own stamp."""
    ahead = ConnectorLeaseCoordinator(pg_stores(time_offset=timedelta(minutes=1)),
                                      AllowAllPolicy())
    _, context = granted(ahead, acquired(ahead, ident), ttl=30)
    token = parse_token(format_token(context))
    assert attempt(context, WRITE) is Reason.CLOCK_BEHIND
    assert attempt(token, WRITE) is Reason.CLOCK_BEHIND
    assert notes(pg_admin, ident.tenant_id) == []


def test_effect_judged_by_the_clock_read_after_the_lock(
        pg_dsn: str, gateway: ConnectorLeaseCoordinator, conn: psycopg.Connection[Any],
        pg_admin: psycopg.Connection[Any], effects: str, ident: LeaseIdentity) -> None:
    """An effect that starts while its context is valid, then waits for the lease row
    across the context's expiry, is refused: time is read once the row is held."""
    _, context = granted(gateway, acquired(gateway, ident), ttl=1)
    verdict: list[Verdict] = []

    def effect() -> None:
        try:
            with fenced_transaction(conn, context, scopes=WRITE) as cur:
                write_note(cur, context, "waited")
            verdict.append(None)
        except FencedEffectRefused as refused:
            verdict.append(refused.reason)

    with psycopg.connect(pg_dsn) as blocker, blocker.transaction():
        blocker.execute("SELECT 1 FROM mos_lease.logical_agent_connector_leases"
                        " WHERE tenant_id = %s "
                        "FOR UPDATE", (ident.tenant_id,))
        thread = threading.Thread(target=effect)
        thread.start()
        thread.join(0.2)
        assert thread.is_alive() and db_now(pg_admin) < context.expires_at
        sleep_until(pg_admin, context.expires_at + timedelta(seconds=0.2))
    thread.join(5)
    assert verdict == [Reason.GRANT_EXPIRED]
    assert notes(pg_admin, ident.tenant_id) == []


# --- scopes: in the current lease and, for a context, in the context ----------------------


def test_effect_scopes(gateway: ConnectorLeaseCoordinator, attempt: Attempt,
                       pg_admin: psycopg.Connection[Any], ident: LeaseIdentity) -> None:
    _, context = granted(gateway, acquired(gateway, ident))  # lease: admin+write; ctx: write
    token = parse_token(format_token(context))
    assert attempt(context, ["effects:write", "effects:write"]) is None
    assert attempt(context, []) is None
    # In the lease, not in the context: the gateway never authorized it for this context.
    assert attempt(context, ["effects:admin"]) is Reason.SCOPE_NOT_AUTHORIZED
    # A token carries no scopes: its effect is authorized as far as the lease goes.
    assert attempt(token, ["effects:admin"]) is None
    # Outside the lease: refused for a token, and for a context that claims it.
    assert attempt(token, ["effects:other"]) is Reason.SCOPE_NOT_AUTHORIZED
    claims = attrs.evolve(context, scopes=("effects:other", "effects:write"))
    assert attempt(claims, ["effects:other"]) is Reason.SCOPE_NOT_AUTHORIZED
    assert notes(pg_admin, ident.tenant_id) == [(1, "effect")] * 3


@pytest.mark.parametrize("scopes", ["effects:write", [7], ["Not A Scope!"], None])
def test_effect_scopes_are_validated(conn: psycopg.Connection[Any], scopes: object) -> None:
    fence = tok(1)
    with pytest.raises(InvalidInput) as caught, \
            fenced_transaction(conn, fence, scopes=scopes):  # type: ignore[arg-type]
        pass
    assert caught.value.field == "scopes"
    assert conn.info.transaction_status == TransactionStatus.IDLE  # nothing was sent


def test_a_malformed_context_is_refused_as_misuse(conn: psycopg.Connection[Any],
                                                  ident: LeaseIdentity) -> None:
    context = ConnectorExecutionContext(ident, "conn-a", tok(1).lease_id, 1, WRITE,
                                        datetime(2030, 1, 1), "corr")  # naive expiry
    with pytest.raises(InvalidInput) as caught, fenced_transaction(conn, context, scopes=WRITE):
        pass
    assert caught.value.field == "expires_at"


# --- every refusal reason, sync and async -------------------------------------------------


def test_every_effect_refusal_reason(gateway: ConnectorLeaseCoordinator, attempt: Attempt,
                                     pg_admin: psycopg.Connection[Any],
                                     ident: LeaseIdentity) -> None:
    handle = acquired(gateway, ident)
    _, context = granted(gateway, handle)
    other = LeaseIdentity(ident.tenant_id, "nobody", "b")
    assert attempt(attrs.evolve(context, identity=other), WRITE) is Reason.LEASE_MISSING
    assert attempt(attrs.evolve(context, lease_id=tok(9).lease_id), WRITE) is \
        Reason.LEASE_REPLACED
    assert attempt(attrs.evolve(context, connector_id="conn-x"), WRITE) is \
        Reason.LEASE_REPLACED
    assert attempt(attrs.evolve(context, epoch=2), WRITE) is Reason.EPOCH_MISMATCH
    # The identity the effect belongs to, as the caller knows it.
    assert attempt(context, WRITE, LeaseIdentity("t-x", "agent-1", "binding-1")) is \
        Reason.TENANT_MISMATCH
    assert attempt(context, WRITE, LeaseIdentity(ident.tenant_id, "agent-x", "binding-1")) \
        is Reason.AGENT_MISMATCH
    assert attempt(context, WRITE, LeaseIdentity(ident.tenant_id, "agent-1", "binding-x")) \
        is Reason.BINDING_MISMATCH
    assert attempt(context, WRITE, ident) is None
    assert attempt(context, ["effects:admin"]) is Reason.SCOPE_NOT_AUTHORIZED
    assert gateway.takeover(ident, "conn-b", scopes=LEASE_SCOPES, ttl=30,
                            expected_epoch=1).ok
    assert attempt(context, WRITE) is Reason.STALE_EPOCH

    released = LeaseIdentity(ident.tenant_id, "agent-1", "released")
    released_handle = acquired(gateway, released)
    _, released_context = granted(gateway, released_handle)
    assert gateway.release(released_handle).ok
    assert attempt(released_context, WRITE) is Reason.LEASE_RELEASED

    short = LeaseIdentity(ident.tenant_id, "agent-1", "short")
    _, short_context = granted(gateway, acquired(gateway, short, ttl=0.3))
    sleep_until(pg_admin, short_context.expires_at)
    # The lease itself expired (the context's expiry was the lease's): named lease_expired,
    # as validation names it.
    assert attempt(short_context, WRITE) is Reason.LEASE_EXPIRED
    assert notes(pg_admin, ident.tenant_id) == [(1, "effect")]


# --- the resource guard: expiry on by default, judged after the row lock ------------------


def test_pg_guard_refuses_an_expired_token_by_default(
        conn: psycopg.Connection[Any], pg_dsn: str, pg_admin: psycopg.Connection[Any],
        ident: LeaseIdentity) -> None:
    lapsed = tok(2, ident, expires_at=db_now(pg_admin) - timedelta(seconds=0.5))
    resource = f"default-{ident.tenant_id}"
    assert PostgresResourceGuard(conn).admit(resource, lapsed) == GuardDecision(
        resource, FenceReason.TOKEN_EXPIRED, None)

    async def in_async() -> GuardDecision:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as connection:
            return await AsyncPostgresResourceGuard(connection).admit(resource, lapsed)

    assert asyncio.run(in_async()) == GuardDecision(resource, FenceReason.TOKEN_EXPIRED, None)
    assert PostgresResourceGuard(conn).state(resource) is None
    # Only the explicit switch judges epochs alone.
    assert PostgresResourceGuard(conn, ignore_expiry=True).admit(resource, lapsed).ok


def test_pg_guard_judges_expiry_after_the_row_lock(
        pg_dsn: str, conn: psycopg.Connection[Any], pg_admin: psycopg.Connection[Any],
        ident: LeaseIdentity) -> None:
    """An admission sent while its token is valid, that waits for the resource row (held by
    another admission's transaction) until past the token's expiry, is refused."""
    resource = f"wait-{ident.tenant_id}"
    expires = db_now(pg_admin) + timedelta(seconds=1)
    holder = tok(1, ident, expires_at=expires + timedelta(minutes=5))
    waiting = tok(1, ident, expires_at=expires)
    decided: list[GuardDecision] = []
    grace = timedelta(0)  # spelled out, so this also runs against the old default-off code

    def contender() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            decided.append(PostgresResourceGuard(other, expiry_grace=grace).admit(
                resource, waiting))

    guard = PostgresResourceGuard(conn, expiry_grace=grace)
    assert guard.admit(resource, holder).ok
    with conn.transaction():
        assert guard.admit(resource, holder).ok  # the resource row is now locked by us
        thread = threading.Thread(target=contender)
        thread.start()
        thread.join(0.3)
        assert thread.is_alive() and db_now(pg_admin) < expires
        sleep_until(pg_admin, expires + timedelta(seconds=0.2))
    thread.join(5)
    assert decided == [GuardDecision(resource, FenceReason.TOKEN_EXPIRED, 1)]


def test_pg_guard_translates_every_driver_error(
        pg_dsn: str, monkeypatch: pytest.MonkeyPatch, ident: LeaseIdentity) -> None:
    """Not only ``OperationalError``: a refused statement (here a read-only session) and an
    ``InterfaceError`` become the library's errors, so a caller handles one family."""
    fresh = tok(1, ident)  # expires in 2030
    with psycopg.connect(pg_dsn, autocommit=True,
                         options="-c default_transaction_read_only=on") as read_only:
        with pytest.raises(MosLeaseError) as caught:
            PostgresResourceGuard(read_only).admit(f"ro-{ident.tenant_id}", fresh)
        assert isinstance(caught.value.__cause__, psycopg.Error)
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        def closed(*_args: object, **_kwargs: object) -> None:
            raise psycopg.InterfaceError("the connection is closed")

        monkeypatch.setattr(connection, "transaction", closed)
        guard = PostgresResourceGuard(connection)
        with pytest.raises(StoreUnavailable):
            guard.admit(f"if-{ident.tenant_id}", fresh)
        with pytest.raises(StoreUnavailable):
            guard.state(f"if-{ident.tenant_id}")
