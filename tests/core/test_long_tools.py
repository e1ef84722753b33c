"""Tools that outlive a grant, on the in-memory store with a manual clock.

A tool runs for minutes (the clock advanced in steps far past the 30 s grant cap) and keeps
writing fenced effects while its lease is held and renewed, in either supported way: the
lease-judged fence (``valid_until=ValidUntil.LEASE``), or the gateway renewing the tool's
grant and context (``renew_grant``). The first effect after a rival's takeover is refused.
Sync and asyncio, every refusal reason of a renewal, and bad input.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from datetime import timedelta

import attrs
import pytest

from mos_lease import (
    AsyncConnectorLeaseCoordinator,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    Outcome,
    Reason,
    StaticConnectorPolicy,
)
from mos_lease.errors import GrantNotTransferable
from mos_lease.fencing import FencedEffectRefused, ValidUntil, check_valid_until
from mos_lease.results import RenewalResult
from mos_lease.token import FencingToken, format_token, parse_token
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_memory import (
    AsyncInMemoryLeaseStore,
    InMemoryResourceGuard,
    fenced_effect,
    fenced_effect_async,
)
from tests.helpers import IDENT, SCOPES, Env, FaultyStore, make_env

RUN = ("tool:run",)
STEP = 5.0  # seconds of store time between two effects of the running tool
MINUTES = 5  # how long the tool runs: ten times the grant cap


def effect_verdict(env: Env, fence: ConnectorExecutionContext | FencingToken,
                   outbox: list[int], **options: object) -> Reason | None:
    """One fenced effect (append the fence's epoch to ``outbox``): its refusal, or None."""
    try:
        fenced_effect(env.store, fence, lambda: outbox.append(fence.epoch), scopes=RUN,
                      **options)  # type: ignore[arg-type]
    except FencedEffectRefused as refused:
        assert isinstance(refused.reason, Reason)
        return refused.reason
    return None


def started_tool(env: Env, lease_ttl: float = 60, grant_ttl: float = 10,
                 ) -> tuple[LeaseHandle, ExecutionGrant, ConnectorExecutionContext]:
    lease = env.acquire(ttl=lease_ttl)
    grant = env.grant(lease, scopes=list(RUN), ttl=grant_ttl)
    checked = env.coordinator.validate(grant, identity=IDENT, scopes=RUN)
    assert checked.context is not None, checked
    return lease, grant, checked.context


def take_over(env: Env, epoch: int) -> None:
    """A rival preempts the running tool's lease (the allow-all policy preempts)."""
    assert env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60,
                                    expected_epoch=epoch).ok


# --- (b) the lease-judged fence -----------------------------------------------------------


def test_a_lease_judged_tool_writes_for_minutes_and_is_fenced_at_the_first_effect_after_a_takeover(
        ) -> None:
    env = make_env()
    lease, _, context = started_tool(env, lease_ttl=60, grant_ttl=10)
    token = parse_token(format_token(context))
    outbox: list[int] = []
    ran_for = 0.0
    while ran_for < MINUTES * 60:
        env.clock.advance(STEP)
        ran_for += STEP
        if ran_for % 20 == 0:  # the gateway's keeper renews the lease, as it would
            renewed = env.coordinator.heartbeat(lease, ttl=60)
            assert renewed.lease is not None
            lease = renewed.lease
        assert effect_verdict(env, context, outbox, valid_until=ValidUntil.LEASE) is None
        assert effect_verdict(env, token, outbox, valid_until="lease") is None
        # Judged by the context, the same effect was refused from the grant's expiry on.
        expected = None if ran_for < 10 else Reason.GRANT_EXPIRED
        assert effect_verdict(env, context, outbox) is expected
    assert env.clock.now() - context.expires_at > timedelta(minutes=MINUTES - 1)
    written = len(outbox)
    assert written == 2 * MINUTES * 60 / STEP + 1  # plus the context effect before 10 s

    take_over(env, epoch=1)
    assert effect_verdict(env, context, outbox, valid_until=ValidUntil.LEASE) is \
        Reason.STALE_EPOCH
    assert effect_verdict(env, token, outbox, valid_until=ValidUntil.LEASE) is \
        Reason.STALE_EPOCH
    assert len(outbox) == written


def test_a_lease_judged_fence_ends_with_the_lease_release_or_expiry() -> None:
    env = make_env()
    _, _, context = started_tool(env, lease_ttl=30)
    outbox: list[int] = []
    env.clock.advance(29)
    assert effect_verdict(env, context, outbox, valid_until=ValidUntil.LEASE) is None
    env.clock.advance(1)  # the holder stopped renewing: the lease expired, nobody took it
    assert effect_verdict(env, context, outbox, valid_until=ValidUntil.LEASE) is \
        Reason.LEASE_EXPIRED

    other = LeaseIdentity("acme", "agent-1", "released")
    held = env.acquire(other)
    grant = env.grant(held, scopes=list(RUN))
    released = env.coordinator.validate(grant, identity=other, scopes=RUN).context
    assert released is not None and env.coordinator.release(held).ok
    assert effect_verdict(env, released, outbox, valid_until=ValidUntil.LEASE) is \
        Reason.LEASE_RELEASED
    assert outbox == [1]


def test_the_lease_judged_fence_keeps_every_other_check() -> None:
    env = make_env()
    _, _, context = started_tool(env)
    outbox: list[int] = []
    lease_only = {"valid_until": ValidUntil.LEASE}
    env.clock.advance(20)  # past the context's expiry: only that check is off
    assert effect_verdict(env, attrs.evolve(context, epoch=2), outbox, **lease_only) is \
        Reason.EPOCH_MISMATCH
    assert effect_verdict(env, attrs.evolve(context, connector_id="conn-x"), outbox,
                          **lease_only) is Reason.LEASE_REPLACED
    missing = attrs.evolve(context, identity=LeaseIdentity("acme", "nobody", "b"))
    assert effect_verdict(env, missing, outbox, **lease_only) is Reason.LEASE_MISSING
    with pytest.raises(FencedEffectRefused) as wrong:
        fenced_effect(env.store, context, lambda: outbox.append(0), scopes=["tool:read"],
                      valid_until=ValidUntil.LEASE)  # in the lease, not in the context
    assert wrong.value.reason is Reason.SCOPE_NOT_AUTHORIZED
    with pytest.raises(FencedEffectRefused) as foreign:
        fenced_effect(env.store, context, lambda: outbox.append(0), scopes=RUN,
                      identity=LeaseIdentity("other", "agent-1", "binding-1"),
                      valid_until=ValidUntil.LEASE)
    assert foreign.value.reason is Reason.TENANT_MISMATCH
    env.clock.step_back(60)  # before the row's own stamp
    assert effect_verdict(env, context, outbox, **lease_only) is Reason.CLOCK_BEHIND
    assert outbox == []


def test_a_fenced_effect_holds_the_store_so_no_takeover_comes_between_check_and_effect(
        ) -> None:
    env = make_env()
    _, _, context = started_tool(env)
    seen: list[int | None] = []

    def effect() -> None:
        # The store may be read inside the effect (its lock is reentrant), and what the
        # effect sees is the lease it was judged against.
        row = env.store.load(IDENT).row
        seen.append(None if row is None else row.epoch)

    assert fenced_effect(env.store, context, effect, scopes=RUN,
                         valid_until=ValidUntil.LEASE) is None
    assert seen == [1]


# --- (a) the gateway renews the tool's grant and context ----------------------------------


def test_a_renewed_tool_writes_for_minutes_and_is_fenced_at_the_first_effect_after_a_takeover(
        ) -> None:
    env = make_env()
    lease, grant, context = started_tool(env, lease_ttl=60, grant_ttl=10)
    guard = InMemoryResourceGuard(clock=env.clock.now)  # a boundary outside the store
    outbox: list[int] = []
    ran_for = 0.0
    renewals = 0
    while ran_for < MINUTES * 60:
        env.clock.advance(STEP)
        ran_for += STEP
        if ran_for % 20 == 0:
            renewed_lease = env.coordinator.heartbeat(lease, ttl=60).lease
            assert renewed_lease is not None
            lease = renewed_lease
        # The gateway renews well before the grant's 10 s run out; the tool's fence sees
        # the renewed context at its next effect.
        renewed = env.coordinator.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10)
        assert renewed.ok and renewed.grant is not None and renewed.context is not None
        renewals += 1
        assert renewed.context.expires_at == env.clock.now() + timedelta(seconds=10)
        assert (renewed.context.lease_id, renewed.context.epoch) == (context.lease_id, 1)
        grant, context = renewed.grant, renewed.context
        assert effect_verdict(env, context, outbox) is None  # judged by its own expiry
        assert guard.admit("mailbox", parse_token(format_token(context))).ok
    assert len(outbox) == renewals == MINUTES * 60 / STEP
    issued = [r for r in env.audit() if r.entry.event is LifecycleEvent.GRANT_ISSUE]
    assert len(issued) == renewals + 1  # one audit row per renewal, as per grant issue
    assert all(r.entry.outcome is Outcome.GRANT_ISSUED for r in issued)

    take_over(env, epoch=1)
    assert effect_verdict(env, context, outbox) is Reason.STALE_EPOCH
    refused = env.coordinator.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10)
    assert (refused.reason, refused.grant, refused.context) == (Reason.STALE_EPOCH, None, None)
    rival = env.coordinator.current_holder(IDENT)
    assert rival is not None and rival.epoch == 2
    last = env.audit()[-1].entry
    assert (last.event, last.outcome, last.reason) == (
        LifecycleEvent.GRANT_ISSUE, Outcome.DENIED, Reason.STALE_EPOCH)
    assert len(outbox) == renewals


def test_a_renewal_never_outlives_the_lease_nor_widens_the_scopes() -> None:
    env = make_env()
    _, grant, _ = started_tool(env, lease_ttl=15, grant_ttl=10)
    env.clock.advance(8)
    renewed = env.coordinator.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10)
    assert renewed.context is not None and renewed.grant is not None
    assert renewed.grant.expires_at == renewed.context.expires_at == \
        env.clock.now() + timedelta(seconds=7)  # the lease's expiry, not now + 10 s
    widened = env.coordinator.renew_grant(renewed.grant, identity=IDENT, scopes=SCOPES, ttl=5)
    assert widened.reason is Reason.SCOPE_NOT_AUTHORIZED
    narrowed = env.coordinator.renew_grant(renewed.grant, identity=IDENT, scopes=(), ttl=5)
    assert narrowed.grant is not None and narrowed.grant.scopes == ()
    assert env.coordinator.validate(narrowed.grant, identity=IDENT, scopes=RUN).reason is \
        Reason.SCOPE_NOT_AUTHORIZED


RenewCase = Callable[[Env, LeaseHandle, ExecutionGrant], RenewalResult]


def _renew(env: Env, grant: object, **overrides: object) -> RenewalResult:
    options: dict[str, object] = {"identity": IDENT, "scopes": RUN, "ttl": 10}
    options.update(overrides)
    return env.coordinator.renew_grant(grant, **options)  # type: ignore[arg-type]


def _expired(env: Env, _: LeaseHandle, grant: ExecutionGrant) -> RenewalResult:
    env.clock.advance(10)  # renewal comes too late: the grant expired, the lease did not
    return _renew(env, grant)


def _released(env: Env, lease: LeaseHandle, grant: ExecutionGrant) -> RenewalResult:
    assert env.coordinator.release(lease).ok
    return _renew(env, grant)


def _lease_expired(env: Env, lease: LeaseHandle, grant: ExecutionGrant) -> RenewalResult:
    # The holder's last renewal was short: the lease expires before the grant does.
    assert env.coordinator.heartbeat(lease, ttl=1).ok
    env.clock.advance(1)
    return _renew(env, grant)


def _taken_over(env: Env, _: LeaseHandle, grant: ExecutionGrant) -> RenewalResult:
    take_over(env, 1)
    return _renew(env, grant)


def _forged(env: Env, _: LeaseHandle, grant: ExecutionGrant) -> RenewalResult:
    return _renew(env, attrs.evolve(grant))  # a look-alike is not the minted object


def _restarted(env: Env, _: LeaseHandle, grant: ExecutionGrant) -> RenewalResult:
    return env.restart().renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10)


RENEWAL_REFUSALS: dict[str, tuple[RenewCase, Reason]] = {
    "grant_expired": (_expired, Reason.GRANT_EXPIRED),
    "lease_released": (_released, Reason.LEASE_RELEASED),
    "lease_expired": (_lease_expired, Reason.LEASE_EXPIRED),
    "stale_epoch": (_taken_over, Reason.STALE_EPOCH),
    "grant_unknown_forged": (_forged, Reason.GRANT_UNKNOWN),
    "grant_unknown_restarted": (_restarted, Reason.GRANT_UNKNOWN),
    "tenant_mismatch": (lambda env, lease, grant: _renew(
        env, grant, identity=LeaseIdentity("other", "agent-1", "binding-1")),
        Reason.TENANT_MISMATCH),
    "binding_mismatch": (lambda env, lease, grant: _renew(
        env, grant, identity=LeaseIdentity("acme", "agent-1", "binding-x")),
        Reason.BINDING_MISMATCH),
    "scope_not_authorized": (lambda env, lease, grant: _renew(env, grant, scopes=SCOPES),
                             Reason.SCOPE_NOT_AUTHORIZED),
}


@pytest.mark.parametrize("case", sorted(RENEWAL_REFUSALS))
def test_every_renewal_refusal_is_validations_reason_and_audited_once(case: str) -> None:
    make_case, reason = RENEWAL_REFUSALS[case]
    env = make_env()
    lease, grant, _ = started_tool(env, lease_ttl=60)
    before = len(env.audit())
    result = make_case(env, lease, grant)
    assert (result.reason, result.ok, result.grant, result.context) == (
        reason, False, None, None)
    denied = env.audit()[-1].entry
    assert (denied.event, denied.outcome, denied.reason) == (
        LifecycleEvent.GRANT_ISSUE, Outcome.DENIED, reason)
    assert len(env.audit()) > before


def test_a_renewal_is_refused_by_the_policy_before_the_lease_is_read() -> None:
    policy = StaticConnectorPolicy.from_dict({"rules": [
        {"tenant_id": "acme", "logical_agent_id": "*", "binding_id": "*",
         "connector_id": "conn-a", "scopes": list(SCOPES), "max_lease_ttl": 60,
         "max_grant_ttl": 10}]})
    env = make_env(policy)
    faulty = FaultyStore(env.store)
    gateway = ConnectorLeaseCoordinator(faulty, policy)
    lease = gateway.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    grant = gateway.issue_grant(lease, scopes=RUN, ttl=10).grant
    assert grant is not None
    loads = faulty.loads
    refused = gateway.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=20)
    assert refused.reason is Reason.TTL_NOT_AUTHORIZED and faulty.loads == loads
    assert env.audit()[-1].entry.reason is Reason.TTL_NOT_AUTHORIZED
    assert gateway.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10).ok


def test_a_renewal_fails_closed_when_the_store_cannot_be_read() -> None:
    env = make_env()
    faulty = FaultyStore(env.store)
    gateway = ConnectorLeaseCoordinator(faulty, env.coordinator._flows.policy)
    lease = gateway.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    grant = gateway.issue_grant(lease, scopes=RUN, ttl=10).grant
    assert grant is not None
    faulty.fail_load = True
    refused = gateway.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10)
    assert refused.reason is Reason.STORE_UNAVAILABLE and refused.grant is None
    assert env.audit()[-1].entry.reason is Reason.STORE_UNAVAILABLE
    faulty.fail_record = True  # the refusal stands even when its audit row cannot be written
    assert gateway.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10).reason is \
        Reason.STORE_UNAVAILABLE
    faulty.fail_load = faulty.fail_record = False
    assert gateway.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10).ok


@pytest.mark.parametrize(("field", "overrides"), [
    ("ttl", {"ttl": 31}), ("ttl", {"ttl": 0}), ("ttl", {"ttl": "10"}),
    ("scopes", {"scopes": "tool:run"}), ("identity", {"identity": ("acme", "a", "b")}),
    ("correlation_id", {"correlation_id": "x" * 10_000}),
])
def test_bad_renewal_input_is_refused_and_writes_nothing(field: str,
                                                          overrides: dict[str, object]) -> None:
    env = make_env()
    _, grant, _ = started_tool(env)
    before = env.state()
    with pytest.raises(InvalidInput) as caught:
        _renew(env, grant, **overrides)
    assert caught.value.field == field
    assert env.state() == before


# --- bad input to a fenced effect ---------------------------------------------------------


@pytest.mark.parametrize("valid_until", [None, 1, "grant", "LEASE", "x" * 100_000,
                                         ValidUntil])
def test_an_unknown_valid_until_is_refused_and_nothing_runs(valid_until: object) -> None:
    env = make_env()
    _, _, context = started_tool(env)
    ran: list[int] = []
    with pytest.raises(InvalidInput) as caught:
        fenced_effect(env.store, context, lambda: ran.append(1), scopes=RUN,
                      valid_until=valid_until)  # type: ignore[arg-type]
    assert caught.value.field == "valid_until" and ran == []
    assert len(str(caught.value)) < 200


def test_check_valid_until_takes_members_and_their_text() -> None:
    assert check_valid_until("lease") is ValidUntil.LEASE
    assert check_valid_until(ValidUntil.CONTEXT) is ValidUntil.CONTEXT


def test_a_fenced_effect_refuses_a_bad_store_fence_or_effect() -> None:
    env = make_env()
    _, _, context = started_tool(env)
    with pytest.raises(InvalidInput) as store:
        fenced_effect(object(), context, lambda: None, scopes=RUN)  # type: ignore[arg-type]
    assert store.value.field == "store"
    with pytest.raises(InvalidInput) as fence:
        fenced_effect(env.store, "mlf1.abc", lambda: None, scopes=RUN)  # type: ignore[arg-type]
    assert fence.value.field == "context"
    with pytest.raises(InvalidInput) as effect:
        fenced_effect(env.store, context, "write", scopes=RUN)  # type: ignore[arg-type]
    assert effect.value.field == "effect"

    async def coroutine_effect() -> None:
        raise AssertionError("never started")

    with pytest.raises(InvalidInput) as awaited:
        fenced_effect(env.store, context, coroutine_effect,  # type: ignore[unused-coroutine]
                      scopes=RUN)
    assert awaited.value.field == "effect"
    with pytest.raises(InvalidInput) as scopes:
        fenced_effect(env.store, context, lambda: None, scopes="tool:run")
    assert scopes.value.field == "scopes"


def test_a_failing_effect_reaches_the_caller_unchanged() -> None:
    env = make_env()
    _, _, context = started_tool(env)

    def broken() -> None:
        raise KeyError("mine")

    with pytest.raises(KeyError):
        fenced_effect(env.store, context, broken, scopes=RUN)
    assert fenced_effect(env.store, context, lambda: 7, scopes=RUN) == 7


# --- asyncio ------------------------------------------------------------------------------


def test_asyncio_a_tool_outlives_its_grant_both_ways_and_is_fenced_after_a_takeover() -> None:
    env = make_env()
    store = AsyncInMemoryLeaseStore(env.store)

    async def main() -> None:
        gateway = AsyncConnectorLeaseCoordinator(store, env.coordinator._flows.policy)
        acquired = await gateway.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60)
        lease = acquired.lease
        assert lease is not None
        grant = (await gateway.issue_grant(lease, scopes=RUN, ttl=10)).grant
        assert grant is not None
        first = (await gateway.validate(grant, identity=IDENT, scopes=RUN)).context
        assert first is not None
        context = first
        outbox: list[str] = []
        for step in range(1, 61):  # five minutes in 5 s steps
            env.clock.advance(STEP)
            if step % 4 == 0:
                renewed_lease = (await gateway.heartbeat(lease, ttl=60)).lease
                assert renewed_lease is not None
                lease = renewed_lease
            renewed = await gateway.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10)
            assert renewed.grant is not None and renewed.context is not None
            grant, context = renewed.grant, renewed.context
            await fenced_effect_async(store, context, lambda: outbox.append("renewed"),
                                      scopes=RUN)
            await fenced_effect_async(store, first, lambda: outbox.append("lease"),
                                      scopes=RUN, valid_until=ValidUntil.LEASE)
        assert outbox == ["renewed", "lease"] * 60
        assert (await gateway.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60,
                                       expected_epoch=1)).ok
        for fence, until in ((context, ValidUntil.CONTEXT), (first, ValidUntil.LEASE)):
            with pytest.raises(FencedEffectRefused) as refused:
                await fenced_effect_async(store, fence, lambda: outbox.append("late"),
                                          scopes=RUN, valid_until=until)
            assert refused.value.reason is Reason.STALE_EPOCH
        late = await gateway.renew_grant(grant, identity=IDENT, scopes=RUN, ttl=10)
        assert late.reason is Reason.STALE_EPOCH
        assert outbox == ["renewed", "lease"] * 60
        with pytest.raises(InvalidInput) as wrong_store:
            await fenced_effect_async(env.store, first, lambda: None,  # type: ignore[arg-type]
                                      scopes=RUN)
        assert wrong_store.value.field == "store"

    asyncio.run(main())


def test_a_renewed_grant_is_process_local_like_every_grant() -> None:
    env = make_env()
    _, grant, _ = started_tool(env)
    renewed = _renew(env, grant)
    assert renewed.grant is not None
    with pytest.raises(GrantNotTransferable):
        copy.copy(renewed.grant)
