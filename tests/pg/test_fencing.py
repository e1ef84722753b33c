"""Resource guards (memory and PostgreSQL) and fenced effects in the lease database."""

from __future__ import annotations

import asyncio
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import attrs
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.pq import TransactionStatus

from mos_lease import (
    AllowAllPolicy,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    LeaseResult,
    Reason,
    StoreUnavailable,
)
from mos_lease.fencing import (
    FencedEffectRefused,
    FenceReason,
    GuardDecision,
    ResourceEpoch,
    ResourceGuard,
    admission_refusal,
    admit,
    check_expiry_grace,
    effect_refusal,
)
from mos_lease.identity import MAX_EPOCH
from mos_lease.records import LeaseRow
from mos_lease.token import FencingToken, format_token, parse_token
from mos_lease_memory.fencing import AsyncInMemoryResourceGuard, InMemoryResourceGuard
from mos_lease_pg.effects import fenced_transaction, fenced_transaction_async
from mos_lease_pg.fencing import AsyncPostgresResourceGuard, PostgresResourceGuard
from tests.pg_fixtures import StoreFactory

NOW = datetime(2030, 1, 1, tzinfo=UTC)
A = LeaseIdentity("acme", "agent-1", "binding-1")
SCOPES = ("effects:write",)
BEFORE = NOW - timedelta(seconds=1)  # a guard's clock while ``tok``'s tokens are unexpired


def tok(epoch: int, identity: LeaseIdentity = A, *, expires_at: datetime = NOW,
        connector: str = "conn-a") -> FencingToken:
    return FencingToken(identity, connector, UUID(int=epoch), epoch, expires_at)


# --- the shared decision ------------------------------------------------------------------


def test_first_token_binds_the_resource() -> None:
    after, decision = admit(None, tok(3), "r1", now=BEFORE)
    assert decision == GuardDecision("r1", None, 3) and decision.ok
    assert after == ResourceEpoch(A, 3)


@pytest.mark.parametrize(("epoch", "reason", "highest"), [
    (4, None, 4),  # equal: the same holder acts again
    (9, None, 9),  # higher: a newer holder; the old one is fenced from now on
    (3, FenceReason.STALE_EPOCH, 4),
    (1, FenceReason.STALE_EPOCH, 4),
])
def test_epoch_order(epoch: int, reason: FenceReason | None, highest: int) -> None:
    current = ResourceEpoch(A, 4)
    after, decision = admit(current, tok(epoch), "r1", now=BEFORE)
    assert decision == GuardDecision("r1", reason, highest)
    assert after == (current if reason else ResourceEpoch(A, highest))


@pytest.mark.parametrize("other", [
    LeaseIdentity("other", "agent-1", "binding-1"),
    LeaseIdentity("acme", "agent-2", "binding-1"),
    LeaseIdentity("acme", "agent-1", "binding-2"),
])
def test_another_identity_is_refused_whatever_its_epoch(other: LeaseIdentity) -> None:
    current = ResourceEpoch(A, 4)
    for epoch in (1, 4, 5, MAX_EPOCH):
        after, decision = admit(current, tok(epoch, other), "r1", now=BEFORE)
        assert decision.reason is FenceReason.IDENTITY_MISMATCH
        assert after is current


def test_expiry_is_judged_unless_switched_off() -> None:
    old = tok(5, expires_at=NOW - timedelta(days=365))
    assert admission_refusal(None, old, now=NOW) is FenceReason.TOKEN_EXPIRED
    assert admission_refusal(None, tok(5), now=NOW) is FenceReason.TOKEN_EXPIRED  # no grace
    assert admission_refusal(None, tok(5), now=NOW - timedelta(microseconds=1)) is None
    assert admission_refusal(None, old, expiry_grace=None) is None  # ignore_expiry=True
    with pytest.raises(InvalidInput, match="now"):
        admission_refusal(None, old)  # on by default: a clock is needed
    grace = timedelta(seconds=2)
    assert admission_refusal(None, tok(5), now=NOW + grace - timedelta(microseconds=1),
                             expiry_grace=grace) is None
    assert admission_refusal(None, tok(5), now=NOW + grace,
                             expiry_grace=grace) is FenceReason.TOKEN_EXPIRED
    # Identity and order come first: they hold whatever the clocks say.
    assert admission_refusal(ResourceEpoch(A, 9), tok(5), now=NOW + grace,
                             expiry_grace=grace) is FenceReason.STALE_EPOCH
    with pytest.raises(InvalidInput, match="now"):
        admission_refusal(None, tok(5), expiry_grace=grace)


@pytest.mark.parametrize("grace", [timedelta(seconds=-1), 2.0, "1s", None])
def test_expiry_grace_is_validated(grace: object) -> None:
    with pytest.raises(InvalidInput):
        check_expiry_grace(grace)
    with pytest.raises(InvalidInput) as caught:
        InMemoryResourceGuard(expiry_grace=grace)  # type: ignore[arg-type]
    if grace is None:  # what used to switch expiry off names the switch that does now
        assert "ignore_expiry=True" in str(caught.value)


@pytest.mark.parametrize("flag", [None, 1, "yes"])
def test_ignore_expiry_must_be_a_bool(flag: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        InMemoryResourceGuard(ignore_expiry=flag)  # type: ignore[arg-type]
    assert caught.value.field == "ignore_expiry"


def test_refused_effect_carries_its_reason() -> None:
    refused = FencedEffectRefused(Reason.STALE_EPOCH, "acme/agent-1/binding-1 epoch 3")
    assert refused.reason is Reason.STALE_EPOCH
    assert "stale_epoch" in str(refused) and "epoch 3" in str(refused)
    assert FencedEffectRefused(FenceReason.TOKEN_EXPIRED).reason == "token_expired"


def lease_row(**changes: Any) -> LeaseRow:
    row = LeaseRow(identity=A, lease_id=UUID(int=4), connector_id="conn-a",
                   scopes=("effects:admin", "effects:write"), epoch=4,
                   acquired_at=NOW - timedelta(seconds=10), heartbeat_at=NOW,
                   expires_at=NOW + timedelta(seconds=30), released_at=None, updated_at=NOW)
    return attrs.evolve(row, **changes)


@pytest.mark.parametrize(("row", "fence", "needed", "granted", "reason"), [
    (lease_row(), tok(4, expires_at=NOW + timedelta(seconds=5)), SCOPES, SCOPES, None),
    (None, tok(4), (), None, Reason.LEASE_MISSING),
    (lease_row(epoch=5), tok(4), (), None, Reason.STALE_EPOCH),
    (lease_row(epoch=3), tok(4), (), None, Reason.EPOCH_MISMATCH),
    (lease_row(connector_id="conn-b"), tok(4), (), None, Reason.LEASE_REPLACED),
    (lease_row(released_at=NOW), tok(4), (), None, Reason.LEASE_RELEASED),
    # The lease's own state is named first, before the fence's expiry.
    (lease_row(expires_at=NOW), tok(4), (), None, Reason.LEASE_EXPIRED),
    # The lease is active but the fence's own validity ran out: what validate says.
    (lease_row(), tok(4, expires_at=NOW), (), None, Reason.GRANT_EXPIRED),
    (lease_row(), tok(4, expires_at=NOW - timedelta(seconds=0.5)), SCOPES, SCOPES,
     Reason.GRANT_EXPIRED),
    # Needed scopes: in the lease and (for a context) in the context.
    (lease_row(), tok(4, expires_at=NOW + timedelta(seconds=5)), ("effects:admin",), SCOPES,
     Reason.SCOPE_NOT_AUTHORIZED),
    (lease_row(), tok(4, expires_at=NOW + timedelta(seconds=5)), ("effects:admin",), None,
     None),  # a token: the lease alone decides
    (lease_row(), tok(4, expires_at=NOW + timedelta(seconds=5)), ("effects:other",),
     ("effects:other",), Reason.SCOPE_NOT_AUTHORIZED),
    (lease_row(), tok(4, expires_at=NOW + timedelta(seconds=5)), ("effects:other",), None,
     Reason.SCOPE_NOT_AUTHORIZED),
])
def test_effect_refusal(row: LeaseRow | None, fence: FencingToken, needed: tuple[str, ...],
                        granted: tuple[str, ...] | None, reason: Reason | None) -> None:
    fence = attrs.evolve(fence, lease_id=UUID(int=4))
    assert effect_refusal(row, NOW, fence, needed=needed, granted=granted) is reason


# --- the in-memory guard ------------------------------------------------------------------

identities = st.sampled_from([A, LeaseIdentity("acme", "agent-1", "binding-2")])
operations = st.lists(st.tuples(st.sampled_from(["r1", "r2", "r3"]), identities,
                                st.integers(1, 6)), max_size=60)


@given(operations)
def test_memory_guard_matches_a_plain_model(ops: list[tuple[str, LeaseIdentity, int]]) -> None:
    """Against the obvious model: a resource belongs to its first identity, and admits an
    epoch exactly when it is at least the highest admitted so far."""
    guard: ResourceGuard = InMemoryResourceGuard()
    model: dict[str, tuple[LeaseIdentity, int]] = {}
    for resource, identity, epoch in ops:
        decision = guard.admit(resource, tok(epoch, identity))
        owner, highest = model.get(resource, (identity, 0))
        if owner != identity:
            assert decision.reason is FenceReason.IDENTITY_MISMATCH
        elif epoch < highest:
            assert decision.reason is FenceReason.STALE_EPOCH
        else:
            assert decision.ok
            model[resource] = (identity, epoch)
        assert decision.highest_epoch == (model[resource][1] if resource in model else None)


Admissions = list[tuple[int, GuardDecision]]


def _race(threads: int,
          attempts: Callable[[random.Random, threading.Barrier], Admissions]) -> Admissions:
    """Run ``attempts`` in ``threads`` threads (each with its own seeded random source and
    the shared start barrier) and return every (epoch tried, decision)."""
    results: Admissions = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def worker(seed: int) -> None:
        local = attempts(random.Random(seed), start)
        with lock:
            results.extend(local)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return results


def _assert_admitted_only_the_highest(results: Admissions) -> None:
    """Every admitted epoch was the highest at its moment (the guard returns it as the new
    highest); every refused one was below the highest."""
    for epoch, decision in results:
        assert decision.highest_epoch is not None
        if decision.ok:
            assert decision.highest_epoch == epoch
        else:
            assert decision.reason is FenceReason.STALE_EPOCH
            assert decision.highest_epoch > epoch


def test_memory_guard_concurrent_admissions_are_atomic() -> None:
    """Eight threads race random epochs at one resource: every admitted epoch was the
    highest at its moment (the guard returns it as the new highest), every refused one
    was below it, and the resource ends at the highest epoch tried."""
    guard = InMemoryResourceGuard()

    def attempts(rng: random.Random, start: threading.Barrier) -> Admissions:
        start.wait()
        return [(e, guard.admit("shared", tok(e))) for e in
                (rng.randint(1, 400) for _ in range(300))]

    results = _race(8, attempts)
    assert len(results) == 2400
    _assert_admitted_only_the_highest(results)
    assert guard.state("shared") == ResourceEpoch(A, max(e for e, _ in results))


def test_memory_guard_expiry_uses_its_clock() -> None:
    now = [NOW]
    guard = InMemoryResourceGuard(expiry_grace=timedelta(seconds=1), clock=lambda: now[0])
    assert guard.admit("r", tok(2, expires_at=NOW + timedelta(seconds=5))).ok
    now[0] = NOW + timedelta(seconds=6)
    refused = guard.admit("r", tok(3, expires_at=NOW + timedelta(seconds=5)))
    assert refused == GuardDecision("r", FenceReason.TOKEN_EXPIRED, 2)
    assert guard.state("r") == ResourceEpoch(A, 2)  # a refusal records nothing
    assert guard.admit("fresh", tok(1, expires_at=NOW)).reason is FenceReason.TOKEN_EXPIRED
    assert guard.state("fresh") is None


def test_memory_guard_refuses_an_expired_token_by_default() -> None:
    """Half a second after its expiry a token is refused by a guard built with no options,
    as gateway validation refuses the grant it came from; only ``ignore_expiry`` admits it."""
    later = NOW + timedelta(seconds=0.5)
    guard = InMemoryResourceGuard(clock=lambda: later)
    assert guard.admit("r", tok(2)) == GuardDecision("r", FenceReason.TOKEN_EXPIRED, None)
    assert guard.admit("r", tok(2, expires_at=later + timedelta(microseconds=1))).ok
    assert InMemoryResourceGuard(ignore_expiry=True, clock=lambda: later).admit(
        "r", tok(2)).ok


@pytest.mark.parametrize(("resource", "token", "field"), [
    ("", tok(1), "resource_id"),
    (" r", tok(1), "resource_id"),
    (7, tok(1), "resource_id"),
    ("r", "mlf1.xyz", "token"),
    ("r", None, "token"),
])
def test_memory_guard_validates_input(resource: object, token: object, field: str) -> None:
    guard = InMemoryResourceGuard()
    with pytest.raises(InvalidInput) as caught:
        guard.admit(resource, token)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert guard.state("r") is None


def test_async_memory_guard() -> None:
    async def scenario() -> None:
        guard = AsyncInMemoryResourceGuard()
        assert (await guard.admit("r", tok(2))).ok
        assert (await guard.admit("r", tok(1))).reason is FenceReason.STALE_EPOCH
        assert guard.sync.state("r") == ResourceEpoch(A, 2)

    asyncio.run(scenario())


# --- PostgreSQL ---------------------------------------------------------------------------
# The fixtures (a migrated database for this run, unique tenants, store factories) are the
# PostgreSQL adapter's, from tests/pg_fixtures.py (registered in tests/conftest.py).

EFFECTS_TABLE = "mos_lease_test_fenced_effects"


@pytest.fixture
def effects(pg_admin: psycopg.Connection[Any]) -> str:
    pg_admin.execute(f"""CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (
        seq bigserial PRIMARY KEY, tenant_id text NOT NULL, epoch bigint NOT NULL,
        note text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())""")
    return EFFECTS_TABLE


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn) as connection:
        yield connection


@pytest.fixture
def ident(pg_tenant: str) -> LeaseIdentity:
    return LeaseIdentity(pg_tenant, "agent-1", "binding-1")


def pg_gateway(pg_stores: StoreFactory) -> ConnectorLeaseCoordinator:
    return ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())


def context_for(coordinator: ConnectorLeaseCoordinator, handle: LeaseHandle
                ) -> ConnectorExecutionContext:
    grant = coordinator.issue_grant(handle, scopes=SCOPES, ttl=30).grant
    assert grant is not None
    checked = coordinator.validate(grant, identity=handle.identity, scopes=SCOPES)
    assert checked.context is not None, checked
    return checked.context


def acquired(coordinator: ConnectorLeaseCoordinator, identity: LeaseIdentity,
             connector: str = "conn-a", ttl: float = 30) -> LeaseHandle:
    result = coordinator.acquire(identity, connector, scopes=SCOPES, ttl=ttl)
    assert result.lease is not None, result
    return result.lease


def status(connection: psycopg.Connection[Any]) -> TransactionStatus:
    return connection.info.transaction_status


def notes(pg_admin: psycopg.Connection[Any], tenant: str) -> list[tuple[int, str]]:
    rows = pg_admin.execute(f"SELECT epoch, note FROM {EFFECTS_TABLE} WHERE tenant_id = %s "
                            "ORDER BY seq", (tenant,)).fetchall()
    return [(int(e), str(n)) for e, n in rows]


def write_note(cur: psycopg.Cursor[Any], fence: ConnectorExecutionContext | FencingToken,
               note: str) -> None:
    cur.execute(f"INSERT INTO {EFFECTS_TABLE} (tenant_id, epoch, note) VALUES (%s, %s, %s)",
                (fence.identity.tenant_id, fence.epoch, note))


# The PostgreSQL guard ---------------------------------------------------------------------


@pytest.mark.pg
def test_pg_guard_orders_epochs(conn: psycopg.Connection[Any], ident: LeaseIdentity) -> None:
    guard = PostgresResourceGuard(conn)
    resource = f"res-{ident.tenant_id}"
    assert guard.state(resource) is None
    assert guard.admit(resource, tok(3, ident)) == GuardDecision(resource, None, 3)
    assert guard.admit(resource, tok(3, ident)) == GuardDecision(resource, None, 3)
    assert guard.admit(resource, tok(5, ident)) == GuardDecision(resource, None, 5)
    assert guard.admit(resource, tok(4, ident)) == GuardDecision(
        resource, FenceReason.STALE_EPOCH, 5)
    other = LeaseIdentity(ident.tenant_id, "agent-1", "binding-2")
    assert guard.admit(resource, tok(9, other)) == GuardDecision(
        resource, FenceReason.IDENTITY_MISMATCH, 5)
    assert guard.state(resource) == ResourceEpoch(ident, 5)
    assert status(conn) == TransactionStatus.IDLE  # each admission commits


@pytest.mark.pg
@settings(max_examples=25, deadline=None)
@given(ops=operations)
def test_pg_guard_matches_the_memory_guard(pg_dsn: str,
                                           ops: list[tuple[str, LeaseIdentity, int]]) -> None:
    """The SQL statement and the shared Python decision agree on every sequence."""
    prefix = secrets.token_hex(6)
    memory = InMemoryResourceGuard()
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        guard = PostgresResourceGuard(connection)
        for resource, identity, epoch in ops:
            token = tok(epoch, identity)
            assert guard.admit(f"{prefix}-{resource}", token) == attrs.evolve(
                memory.admit(resource, token), resource_id=f"{prefix}-{resource}")


@pytest.mark.pg
def test_pg_guard_expiry_by_database_clock(conn: psycopg.Connection[Any],
                                           ident: LeaseIdentity) -> None:
    guard = PostgresResourceGuard(conn, expiry_grace=timedelta(seconds=1))
    db_now: datetime = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    conn.commit()
    resource = f"exp-{ident.tenant_id}"
    stale = tok(2, ident, expires_at=db_now - timedelta(seconds=5))
    assert guard.admit(resource, stale) == GuardDecision(resource, FenceReason.TOKEN_EXPIRED,
                                                         None)
    assert guard.state(resource) is None
    fresh = tok(2, ident, expires_at=db_now + timedelta(minutes=5))
    assert guard.admit(resource, fresh).ok
    assert guard.admit(resource, attrs.evolve(stale, epoch=3)) == GuardDecision(
        resource, FenceReason.TOKEN_EXPIRED, 2)
    # On by default, with no grace; only an explicit switch ignores expiry.
    assert PostgresResourceGuard(conn).admit(resource, attrs.evolve(stale, epoch=3)) == \
        GuardDecision(resource, FenceReason.TOKEN_EXPIRED, 2)
    assert PostgresResourceGuard(conn, ignore_expiry=True).admit(
        resource, attrs.evolve(stale, epoch=3)).ok


@pytest.mark.pg
def test_pg_guard_concurrent_admissions_are_atomic(pg_dsn: str, ident: LeaseIdentity) -> None:
    resource = f"race-{ident.tenant_id}"

    def attempts(rng: random.Random, start: threading.Barrier) -> Admissions:
        with psycopg.connect(pg_dsn, autocommit=True) as connection:
            guard = PostgresResourceGuard(connection)
            start.wait()
            return [(e, guard.admit(resource, tok(e, ident)))
                    for e in (rng.randint(1, 200) for _ in range(60))]

    results = _race(4, attempts)
    assert len(results) == 240
    _assert_admitted_only_the_highest(results)
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        assert PostgresResourceGuard(connection).state(resource) == ResourceEpoch(
            ident, max(e for e, _ in results))


@pytest.mark.pg
def test_pg_guard_inside_a_transaction_holds_off_newer_epochs(
        pg_dsn: str, conn: psycopg.Connection[Any], ident: LeaseIdentity) -> None:
    """Admission and effect in one transaction: until it commits, a newer epoch waits."""
    resource = f"tx-{ident.tenant_id}"
    guard = PostgresResourceGuard(conn)
    assert guard.admit(resource, tok(1, ident)).ok
    newer: list[GuardDecision] = []
    with conn.transaction():
        assert guard.admit(resource, tok(1, ident)).ok  # epoch row now locked by us

        def contender() -> None:
            with psycopg.connect(pg_dsn, autocommit=True) as other:
                newer.append(PostgresResourceGuard(other).admit(resource, tok(2, ident)))

        thread = threading.Thread(target=contender)
        thread.start()
        thread.join(0.4)
        assert thread.is_alive() and newer == []  # waiting for our transaction
    thread.join(5)
    assert newer == [GuardDecision(resource, None, 2)]


@pytest.mark.pg
def test_pg_guard_fails_closed_when_the_database_is_gone(pg_dsn: str,
                                                         ident: LeaseIdentity) -> None:
    connection = psycopg.connect(pg_dsn, autocommit=True)
    guard = PostgresResourceGuard(connection)
    connection.close()
    with pytest.raises(StoreUnavailable):
        guard.admit("gone", tok(1, ident))
    with pytest.raises(StoreUnavailable):
        guard.state("gone")


@pytest.mark.pg
def test_async_pg_guard(pg_dsn: str, ident: LeaseIdentity) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as connection:
            guard = AsyncPostgresResourceGuard(connection)
            resource = f"async-{ident.tenant_id}"
            assert (await guard.admit(resource, tok(2, ident))).ok
            assert (await guard.admit(resource, tok(1, ident))).reason is \
                FenceReason.STALE_EPOCH
            assert await guard.state(resource) == ResourceEpoch(ident, 2)

    asyncio.run(scenario())


# Fenced effects in the lease database -----------------------------------------------------


@pytest.mark.pg
def test_fenced_effect_commits_with_a_current_lease(
        pg_stores: StoreFactory, conn: psycopg.Connection[Any], pg_admin: psycopg.Connection[Any],
        effects: str, ident: LeaseIdentity) -> None:
    gateway = pg_gateway(pg_stores)
    context = context_for(gateway, acquired(gateway, ident))
    with fenced_transaction(conn, context, scopes=SCOPES) as cur:
        write_note(cur, context, "first")
        assert status(conn) == TransactionStatus.INTRANS
    assert status(conn) == TransactionStatus.IDLE
    # A token parsed off a message fences just as well as the context.
    token = parse_token(format_token(context))
    with fenced_transaction(conn, token, scopes=SCOPES) as cur:
        write_note(cur, token, "second")
    assert notes(pg_admin, ident.tenant_id) == [(1, "first"), (1, "second")]


@pytest.mark.pg
def test_fenced_effect_refusals(pg_stores: StoreFactory, conn: psycopg.Connection[Any],
                                pg_admin: psycopg.Connection[Any], effects: str,
                                ident: LeaseIdentity) -> None:
    gateway = pg_gateway(pg_stores)
    handle = acquired(gateway, ident)
    context = context_for(gateway, handle)

    def refused(fence: ConnectorExecutionContext | FencingToken) -> Reason | FenceReason:
        with pytest.raises(FencedEffectRefused) as caught, \
                fenced_transaction(conn, fence, scopes=SCOPES) as cur:
            write_note(cur, fence, "must not commit")
        assert status(conn) == TransactionStatus.IDLE
        return caught.value.reason

    missing = attrs.evolve(context, identity=LeaseIdentity(ident.tenant_id, "nobody", "b"))
    assert refused(missing) is Reason.LEASE_MISSING
    assert refused(attrs.evolve(context, lease_id=UUID(int=1))) is Reason.LEASE_REPLACED
    assert refused(attrs.evolve(context, connector_id="conn-x")) is Reason.LEASE_REPLACED
    assert refused(attrs.evolve(context, epoch=2)) is Reason.EPOCH_MISMATCH
    assert gateway.takeover(ident, "conn-b", scopes=SCOPES, ttl=30, expected_epoch=1).ok
    assert refused(context) is Reason.STALE_EPOCH
    assert notes(pg_admin, ident.tenant_id) == []

    released = LeaseIdentity(ident.tenant_id, "agent-1", "released")
    released_handle = acquired(gateway, released)
    released_context = context_for(gateway, released_handle)
    assert gateway.release(released_handle).ok
    assert refused(released_context) is Reason.LEASE_RELEASED

    short = LeaseIdentity(ident.tenant_id, "agent-1", "short")
    short_context = context_for(gateway, acquired(gateway, short, ttl=0.3))
    time.sleep(0.35)
    assert refused(short_context) is Reason.LEASE_EXPIRED
    assert notes(pg_admin, ident.tenant_id) == []


@pytest.mark.pg
def test_fenced_effect_rolls_back_on_error_and_refuses_nesting(
        pg_stores: StoreFactory, conn: psycopg.Connection[Any], pg_admin: psycopg.Connection[Any],
        effects: str, ident: LeaseIdentity) -> None:
    gateway = pg_gateway(pg_stores)
    context = context_for(gateway, acquired(gateway, ident))
    with pytest.raises(RuntimeError, match="caller"), \
            fenced_transaction(conn, context, scopes=SCOPES) as cur:
        write_note(cur, context, "rolled back")
        raise RuntimeError("caller failed")
    assert notes(pg_admin, ident.tenant_id) == []
    conn.execute("SELECT 1")  # an implicit transaction is now open on conn
    with pytest.raises(InvalidInput) as caught, fenced_transaction(conn, context, scopes=()):
        pass
    assert caught.value.field == "conn"
    conn.rollback()
    with pytest.raises(InvalidInput) as caught, \
            fenced_transaction(conn, "mlf1.x", scopes=()):  # type: ignore[arg-type]
        pass
    assert caught.value.field == "context"


@pytest.mark.pg
def test_takeover_waits_for_an_open_fenced_effect(
        pg_dsn: str, pg_stores: StoreFactory, conn: psycopg.Connection[Any],
        pg_admin: psycopg.Connection[Any], effects: str, ident: LeaseIdentity) -> None:
    """The race the helper exists for: a takeover committed while an effect's transaction
    holds the lease row must wait for it; the effect commits first, under the old epoch,
    and anything the old holder tries afterwards is refused."""
    holder = pg_gateway(pg_stores)
    context = context_for(holder, acquired(holder, ident))
    successor = pg_gateway(pg_stores)
    taken: list[LeaseResult] = []

    def take_over() -> None:
        taken.append(successor.takeover(ident, "conn-b", scopes=SCOPES, ttl=30,
                                        expected_epoch=1))

    with fenced_transaction(conn, context, scopes=SCOPES) as cur:
        thread = threading.Thread(target=take_over)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and taken == []  # blocked on our FOR SHARE lock
        write_note(cur, context, "in flight")
    thread.join(5)
    assert len(taken) == 1 and taken[0].ok
    new_lease = taken[0].lease
    assert new_lease is not None and new_lease.epoch == 2
    with pytest.raises(FencedEffectRefused) as caught, \
            fenced_transaction(conn, context, scopes=SCOPES) as cur:
        write_note(cur, context, "too late")
    assert caught.value.reason is Reason.STALE_EPOCH
    assert notes(pg_admin, ident.tenant_id) == [(1, "in flight")]


@pytest.mark.pg
def test_an_effect_waits_for_a_takeover_in_flight_then_is_refused(
        pg_dsn: str, pg_stores: StoreFactory, conn: psycopg.Connection[Any],
        pg_admin: psycopg.Connection[Any], effects: str, ident: LeaseIdentity) -> None:
    """The other order: the lease row is being replaced by a write that has not committed
    yet. The effect waits for it and then sees the new epoch, instead of the old row."""
    holder = pg_gateway(pg_stores)
    context = context_for(holder, acquired(holder, ident))
    outcome: list[BaseException | None] = []

    def effect() -> None:
        with psycopg.connect(pg_dsn) as own:
            try:
                with fenced_transaction(own, context, scopes=SCOPES) as cur:
                    write_note(cur, context, "raced")
            except FencedEffectRefused as refused:
                outcome.append(refused)
            else:
                outcome.append(None)

    with psycopg.connect(pg_dsn) as writer, writer.transaction():
        # What a takeover statement does to the row, held open so the effect must meet it.
        writer.execute(
            "UPDATE mos_lease.logical_agent_connector_leases SET epoch = epoch + 1, "
            "lease_id = gen_random_uuid(), connector_id = 'conn-b', "
            "acquired_at = clock_timestamp(), heartbeat_at = clock_timestamp(), "
            "expires_at = clock_timestamp() + interval '30 seconds', "
            "updated_at = clock_timestamp(), released_at = NULL WHERE tenant_id = %s",
            (ident.tenant_id,))
        thread = threading.Thread(target=effect)
        thread.start()
        thread.join(0.4)
        assert thread.is_alive() and outcome == []
    thread.join(5)
    assert len(outcome) == 1 and isinstance(outcome[0], FencedEffectRefused)
    assert outcome[0].reason is Reason.STALE_EPOCH
    assert notes(pg_admin, ident.tenant_id) == []


@pytest.mark.pg
def test_async_fenced_effect(pg_dsn: str, pg_stores: StoreFactory,
                             pg_admin: psycopg.Connection[Any], effects: str,
                             ident: LeaseIdentity) -> None:
    gateway = pg_gateway(pg_stores)
    context = context_for(gateway, acquired(gateway, ident))

    async def scenario() -> Reason | FenceReason:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as connection:
            async with fenced_transaction_async(connection, context, scopes=SCOPES) as cur:
                await cur.execute(f"INSERT INTO {EFFECTS_TABLE} (tenant_id, epoch, note) "
                                  "VALUES (%s, %s, %s)", (ident.tenant_id, 1, "async"))
            assert gateway.takeover(ident, "conn-b", scopes=SCOPES, ttl=30,
                                    expected_epoch=1).ok
            with pytest.raises(FencedEffectRefused) as caught:
                async with fenced_transaction_async(connection, context,
                                                    scopes=SCOPES) as cur:
                    await cur.execute("SELECT 1")
            return caught.value.reason

    assert asyncio.run(scenario()) is Reason.STALE_EPOCH
    assert notes(pg_admin, ident.tenant_id) == [(1, "async")]
