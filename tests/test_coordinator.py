"""The synchronous coordinator on the in-memory store: input checks, option caps, every denial
reason provoked for real, lifecycle semantics, lost commits and racing threads."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from uuid import UUID

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mos_lease import (
    GRANT_TTL_CAP,
    LEASE_TTL_CAP,
    MAX_EPOCH,
    AllowAllPolicy,
    AuditRecord,
    ConfigurationError,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    LeaseState,
    LifecycleEvent,
    Outcome,
    PolicyRequest,
    PolicyVerdict,
    Reason,
    StaticConnectorPolicy,
    StoreUnavailable,
)
from mos_lease.machine import Insert
from mos_lease.records import AuditEntry
from mos_lease_memory import InMemoryLeaseStore, ManualClock
from tests.helpers import (
    IDENT,
    OTHER_IDENT,
    SCOPES,
    CountingIds,
    Env,
    FaultyStore,
    expire,
    make_env,
    put_row,
    row_of,
)

# --- bad input -----------------------------------------------------------------------------

BAD_IDS: list[object] = ["", "x" * 129, " pad", "pad ", "n\x00", "d\x7f", "b\u202e", "z\u200b",
                         "\ud800", None, 5, b"conn"]
BAD_SCOPES: list[object] = ["tool:run", 5, None, [1], ["Tool"], ["a b"], ["a::b"], [":a"],
                            [f"s{i}" for i in range(65)], ["a" * 129]]
BAD_LEASE_TTLS: list[object] = [0, -1, float("nan"), float("inf"), True, "10", None, 301,
                                timedelta(0), timedelta(seconds=-5)]
BAD_GRANT_TTLS: list[object] = [0, -1, float("nan"), float("inf"), False, "5", 31,
                                timedelta(0)]
BAD_EPOCHS: list[object] = [0, -1, True, MAX_EPOCH + 1, 1.0, "1", None]
BAD_CORRELATIONS: list[object] = ["", " req", "req\n", 7, b"req"]


@attrs.frozen
class Fixture:
    """A live lease and grant to aim malformed calls at."""

    env: Env
    lease: LeaseHandle
    grant: ExecutionGrant


def _fixture() -> Fixture:
    env = make_env()
    lease = env.acquire()
    issued = env.coordinator.issue_grant(lease, scopes=["tool:run"], ttl=10)
    assert issued.grant is not None
    return Fixture(env, lease, issued.grant)


def _noop_adapter(context: ConnectorExecutionContext) -> str:
    return "ran"


Call = Callable[[Fixture, Any], object]


def _calls() -> list[tuple[str, str, Call, list[object]]]:
    """(method, field, call with the bad value in that field, bad values)."""
    def c(f: Fixture) -> ConnectorLeaseCoordinator:
        return f.env.coordinator

    def handle_with(**changes: Any) -> Callable[[Fixture], LeaseHandle]:
        return lambda f: attrs.evolve(f.lease, **changes)

    calls: list[tuple[str, str, Call, list[object]]] = [
        ("acquire", "identity", lambda f, v: c(f).acquire(
            v, "conn-b", scopes=SCOPES, ttl=10), [None, "acme/agent-1/binding-1", ("a",)]),
        ("acquire", "connector_id", lambda f, v: c(f).acquire(
            IDENT, v, scopes=SCOPES, ttl=10), BAD_IDS),
        ("acquire", "scopes", lambda f, v: c(f).acquire(
            IDENT, "conn-b", scopes=v, ttl=10), BAD_SCOPES),
        ("acquire", "ttl", lambda f, v: c(f).acquire(
            IDENT, "conn-b", scopes=SCOPES, ttl=v), BAD_LEASE_TTLS),
        ("acquire", "correlation_id", lambda f, v: c(f).acquire(
            IDENT, "conn-b", scopes=SCOPES, ttl=10, correlation_id=v), BAD_CORRELATIONS),
        ("takeover", "identity", lambda f, v: c(f).takeover(
            v, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1), [None, "x"]),
        ("takeover", "connector_id", lambda f, v: c(f).takeover(
            IDENT, v, scopes=SCOPES, ttl=10, expected_epoch=1), BAD_IDS),
        ("takeover", "scopes", lambda f, v: c(f).takeover(
            IDENT, "conn-b", scopes=v, ttl=10, expected_epoch=1), BAD_SCOPES),
        ("takeover", "ttl", lambda f, v: c(f).takeover(
            IDENT, "conn-b", scopes=SCOPES, ttl=v, expected_epoch=1), BAD_LEASE_TTLS),
        ("takeover", "expected_epoch", lambda f, v: c(f).takeover(
            IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=v), BAD_EPOCHS),
        ("takeover", "correlation_id", lambda f, v: c(f).takeover(
            IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1, correlation_id=v),
         BAD_CORRELATIONS),
    ]
    for method in ("heartbeat", "release", "issue_grant"):
        calls += _handle_calls(method, handle_with)
    calls += [
        ("heartbeat", "ttl", lambda f, v: c(f).heartbeat(f.lease, ttl=v), BAD_LEASE_TTLS),
        ("issue_grant", "scopes", lambda f, v: c(f).issue_grant(
            f.lease, scopes=v, ttl=5), BAD_SCOPES),
        ("issue_grant", "ttl", lambda f, v: c(f).issue_grant(
            f.lease, scopes=["tool:run"], ttl=v), BAD_GRANT_TTLS),
        ("heartbeat_many", "leases", lambda f, v: c(f).heartbeat_many(v, ttl=10),
         [None, 5, "leases", iter(()), {"a": 1}]),
        ("heartbeat_many", "leases", lambda f, v: c(f).heartbeat_many(
            [f.lease] * v, ttl=10), [1001]),
        ("heartbeat_many", "leases", lambda f, v: c(f).heartbeat_many(
            cast(Any, attrs.evolve(f.lease, epoch=v)), ttl=10), [1]),  # a handle, no batch
        ("heartbeat_many", "lease.epoch", lambda f, v: c(f).heartbeat_many(
            [f.lease, attrs.evolve(f.lease, epoch=v)], ttl=10), BAD_EPOCHS),
        ("heartbeat_many", "ttl", lambda f, v: c(f).heartbeat_many([f.lease], ttl=v),
         BAD_LEASE_TTLS),
        ("heartbeat_many", "correlation_id", lambda f, v: c(f).heartbeat_many(
            [f.lease], ttl=10, correlation_id=v), BAD_CORRELATIONS),
        ("validate", "identity", lambda f, v: c(f).validate(
            f.grant, identity=v, scopes=["tool:run"]), [None, "x", ("a", "b", "c")]),
        ("validate", "scopes", lambda f, v: c(f).validate(
            f.grant, identity=IDENT, scopes=v), BAD_SCOPES),
        ("validate", "correlation_id", lambda f, v: c(f).validate(
            f.grant, identity=IDENT, scopes=["tool:run"], correlation_id=v),
         BAD_CORRELATIONS),
        ("invoke", "identity", lambda f, v: c(f).invoke(
            f.grant, _noop_adapter, identity=v, scopes=["tool:run"]), [None, "x"]),
        ("invoke", "scopes", lambda f, v: c(f).invoke(
            f.grant, _noop_adapter, identity=IDENT, scopes=v), BAD_SCOPES),
        ("invoke", "correlation_id", lambda f, v: c(f).invoke(
            f.grant, _noop_adapter, identity=IDENT, scopes=["tool:run"], correlation_id=v),
         BAD_CORRELATIONS),
    ]
    return calls


def _handle_calls(method: str, handle_with: Callable[..., Callable[[Fixture], LeaseHandle]],
                  ) -> list[tuple[str, str, Call, list[object]]]:
    """Bad values in each part of the lease handle of heartbeat, release or issue_grant."""
    def run(f: Fixture, lease: object, **kw: object) -> object:
        fn: Callable[..., object] = getattr(f.env.coordinator, method)
        if method == "heartbeat":
            return fn(lease, ttl=10, **_corr(kw))
        if method == "release":
            return fn(lease, **_corr(kw))
        return fn(lease, scopes=["tool:run"], ttl=5, **_corr(kw))

    return [
        (method, "lease", run, [None, "lease", {"epoch": 1}, IDENT]),
        (method, "lease.identity", lambda f, v: run(f, handle_with(identity=v)(f)),
         [None, "acme/agent-1/binding-1"]),
        (method, "lease.connector_id", lambda f, v: run(f, handle_with(connector_id=v)(f)),
         BAD_IDS),
        (method, "lease.lease_id", lambda f, v: run(f, handle_with(lease_id=v)(f)),
         [None, str(UUID(int=1)), 1]),
        (method, "lease.epoch", lambda f, v: run(f, handle_with(epoch=v)(f)), BAD_EPOCHS),
        (method, "correlation_id", lambda f, v: run(f, f.lease, correlation_id=v),
         BAD_CORRELATIONS),
    ]


def _corr(kw: dict[str, object]) -> dict[str, object]:
    return {"correlation_id": kw["correlation_id"]} if "correlation_id" in kw else {}


BAD_INPUT_CASES = [
    pytest.param(call, field, value, id=f"{method}-{field}-{value!r:.30}")
    for method, field, call, values in _calls() for value in values
]


@pytest.mark.parametrize(("call", "field", "value"), BAD_INPUT_CASES)
def test_bad_input_raises_invalid_input_naming_the_field_and_writes_nothing(
        call: Call, field: str, value: object) -> None:
    f = _fixture()
    before = f.env.state()
    live = f.env.coordinator.live_grants
    with pytest.raises(InvalidInput) as caught:
        call(f, value)
    assert caught.value.field == field
    assert f.env.state() == before
    assert f.env.coordinator.live_grants == live


def test_every_public_method_has_bad_input_cases() -> None:
    covered = {method for method, _, _, _ in _calls()}
    assert covered == {"acquire", "takeover", "heartbeat", "heartbeat_many", "release",
                       "issue_grant", "validate", "invoke"}


def test_a_handle_with_malformed_scopes_is_bad_input() -> None:
    """The handle's scopes go to the policy (heartbeat, release) unchecked today: a hand-built
    handle with ``scopes=5`` reaches ``StaticConnectorPolicy`` and crashes there with a bare
    TypeError, or is accepted by a policy that does not look at scopes."""
    kwargs: dict[str, dict[str, Any]] = {
        "heartbeat": {"ttl": 10}, "release": {}, "issue_grant": {"scopes": ["tool:run"],
                                                                 "ttl": 5}}
    accepted = []
    for method, extra in kwargs.items():
        bad_scopes: list[Any] = ["tool:run", 5, None, ["Tool"]]
        for scopes in bad_scopes:
            f = _fixture()
            before = f.env.state()
            fn: Callable[..., object] = getattr(f.env.coordinator, method)
            try:
                fn(attrs.evolve(f.lease, scopes=scopes), **extra)
            except InvalidInput as bad:
                assert bad.field == "lease.scopes"
                assert f.env.state() == before
            else:
                accepted.append(f"{method}(scopes={scopes!r})")
    assert accepted == []


def test_invoke_refuses_a_non_callable_adapter_before_validating() -> None:
    """A non-callable adapter is bad input; today it passes validation and then fails with a
    TypeError from inside ``invoke``."""
    f = _fixture()
    before = f.env.state()
    with pytest.raises(InvalidInput) as caught:
        f.env.coordinator.invoke(f.grant, None, identity=IDENT,  # type: ignore[arg-type]
                                 scopes=["tool:run"])
    assert caught.value.field == "adapter"
    assert f.env.state() == before


ARBITRARY = st.one_of(
    st.lists(st.integers(0, sys.maxunicode).map(chr), max_size=140).map("".join),
    st.text(max_size=20), st.integers(), st.floats(), st.none(), st.booleans(), st.binary(),
    st.lists(st.text(max_size=3), max_size=3), st.builds(object),
)

FUZZ_TARGETS: dict[str, tuple[str, Call]] = {
    "acquire.connector_id": ("connector_id", lambda f, v: f.env.coordinator.acquire(
        IDENT, v, scopes=SCOPES, ttl=10)),
    "acquire.identity": ("identity", lambda f, v: f.env.coordinator.acquire(
        v, "conn-b", scopes=SCOPES, ttl=10)),
    "acquire.correlation_id": ("correlation_id", lambda f, v: f.env.coordinator.acquire(
        IDENT, "conn-b", scopes=SCOPES, ttl=10, correlation_id=v)),
    "takeover.connector_id": ("connector_id", lambda f, v: f.env.coordinator.takeover(
        IDENT, v, scopes=SCOPES, ttl=10, expected_epoch=1)),
    "takeover.expected_epoch": ("expected_epoch", lambda f, v: f.env.coordinator.takeover(
        IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=v)),
    "heartbeat.lease.connector_id": ("lease.connector_id", lambda f, v: (
        f.env.coordinator.heartbeat(attrs.evolve(f.lease, connector_id=v), ttl=10))),
    "release.correlation_id": ("correlation_id", lambda f, v: f.env.coordinator.release(
        f.lease, correlation_id=v)),
    "issue_grant.lease.connector_id": ("lease.connector_id", lambda f, v: (
        f.env.coordinator.issue_grant(attrs.evolve(f.lease, connector_id=v),
                                      scopes=["tool:run"], ttl=5))),
    "validate.identity": ("identity", lambda f, v: f.env.coordinator.validate(
        f.grant, identity=v, scopes=["tool:run"])),
    "validate.correlation_id": ("correlation_id", lambda f, v: f.env.coordinator.validate(
        f.grant, identity=IDENT, scopes=["tool:run"], correlation_id=v)),
    "invoke.identity": ("identity", lambda f, v: f.env.coordinator.invoke(
        f.grant, _noop_adapter, identity=v, scopes=["tool:run"])),
    "identity.tenant_id": ("tenant_id", lambda f, v: LeaseIdentity(
        v, "agent-1", "binding-1")),
    "identity.binding_id": ("binding_id", lambda f, v: LeaseIdentity(
        "acme", "agent-1", v)),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(target=st.sampled_from(sorted(FUZZ_TARGETS)), value=ARBITRARY)
def test_arbitrary_ids_raise_only_invalid_input_and_write_nothing(
        target: str, value: object) -> None:
    field, call = FUZZ_TARGETS[target]
    f = _fixture()
    before = f.env.state()
    try:
        call(f, value)
    except InvalidInput as bad:
        assert bad.field == field
        assert f.env.state() == before
    else:
        # Accepted: then it was a well-formed value of the right type.
        if field == "expected_epoch":
            assert type(value) is int
        elif field == "identity":
            assert isinstance(value, LeaseIdentity)
        elif field == "correlation_id":
            assert value is None or isinstance(value, str)
        else:
            assert isinstance(value, str)


# --- option caps ---------------------------------------------------------------------------


def test_lowered_lease_cap_is_enforced_everywhere() -> None:
    env = make_env(lease_ttl_cap=timedelta(seconds=10))
    with pytest.raises(InvalidInput) as caught:
        env.coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=11)
    assert caught.value.field == "ttl"
    lease = env.acquire(ttl=10)
    with pytest.raises(InvalidInput):
        env.coordinator.heartbeat(lease, ttl=10.5)
    with pytest.raises(InvalidInput):
        env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=timedelta(seconds=11),
                                 expected_epoch=1)
    assert env.coordinator.heartbeat(lease, ttl=10).ok


def test_lowered_grant_cap_is_enforced() -> None:
    env = make_env(grant_ttl_cap=5)
    lease = env.acquire()
    with pytest.raises(InvalidInput) as caught:
        env.coordinator.issue_grant(lease, scopes=["tool:run"], ttl=6)
    assert caught.value.field == "ttl"
    assert env.coordinator.issue_grant(lease, scopes=["tool:run"], ttl=5).ok


@pytest.mark.parametrize("option", ["lease_ttl_cap", "grant_ttl_cap"])
def test_caps_equal_to_the_hard_limit_are_accepted(option: str) -> None:
    cap = LEASE_TTL_CAP if option == "lease_ttl_cap" else GRANT_TTL_CAP
    options: dict[str, Any] = {option: cap}
    clock = ManualClock()
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(clock), AllowAllPolicy(),
                                            **options)
    lease = coordinator.acquire(IDENT, "conn-a", scopes=[], ttl=LEASE_TTL_CAP).lease
    assert lease is not None and lease.expires_at == clock.now() + LEASE_TTL_CAP
    assert coordinator.issue_grant(lease, scopes=[], ttl=GRANT_TTL_CAP).ok


@pytest.mark.parametrize(("option", "value"), [
    ("lease_ttl_cap", 301), ("lease_ttl_cap", timedelta(minutes=5, microseconds=1)),
    ("lease_ttl_cap", 0), ("lease_ttl_cap", -1), ("lease_ttl_cap", timedelta(0)),
    ("lease_ttl_cap", float("nan")), ("lease_ttl_cap", True), ("lease_ttl_cap", "60"),
    ("grant_ttl_cap", 31), ("grant_ttl_cap", timedelta(seconds=30, microseconds=1)),
    ("grant_ttl_cap", 0), ("grant_ttl_cap", -5), ("grant_ttl_cap", float("inf")),
    ("grant_ttl_cap", None),
    ("max_conflict_retries", -1), ("max_conflict_retries", 101), ("max_conflict_retries", True),
], ids=repr)
def test_caps_only_tighten(option: str, value: object) -> None:
    options: dict[str, Any] = {option: value}
    with pytest.raises(ConfigurationError):
        ConnectorLeaseCoordinator(InMemoryLeaseStore(ManualClock()), **options)


def test_constructor_refuses_a_non_policy_or_non_callable_id_source() -> None:
    """Misconfiguration should fail at construction with ConfigurationError, not as an
    AttributeError/TypeError on the first request."""
    accepted = []
    for option, value in [("policy", "allow-all"), ("policy", AllowAllPolicy),
                          ("policy", 42), ("id_source", None), ("id_source", "uuid4")]:
        options: dict[str, Any] = {"policy": AllowAllPolicy(), option: value}
        try:
            ConnectorLeaseCoordinator(InMemoryLeaseStore(ManualClock()), **options)
        except ConfigurationError:
            continue
        accepted.append(f"{option}={value!r}")
    assert accepted == []


def test_a_policy_returning_something_else_is_a_configuration_error() -> None:
    class Sloppy:
        def authorize(self, request: PolicyRequest) -> PolicyVerdict:
            return True  # type: ignore[return-value]

    env = make_env(Sloppy())
    with pytest.raises(ConfigurationError):
        env.coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
    assert env.state() == ([], [])


# --- every denial reason, provoked for real --------------------------------------------------


@attrs.frozen
class Provoked:
    """One real denial: what the call returned and the audit rows it appended."""

    reason: Reason | None
    event: LifecycleEvent
    epoch: int | None
    connector_id: str
    identity: LeaseIdentity
    rows: list[AuditRecord]
    current_epoch: int | None = None
    expected_current_epoch: int | None = None


def _provoke(env: Env, event: LifecycleEvent, epoch: int | None, connector_id: str,
             call: Callable[[], Any], identity: LeaseIdentity = IDENT,
             current_epoch: int | None = None) -> Provoked:
    before = len(env.audit())
    result = call()
    return Provoked(result.reason, event, epoch, connector_id, identity, env.audit()[before:],
                    getattr(result, "current_epoch", None), current_epoch)


def _grant(env: Env, lease: LeaseHandle, scopes: list[str] | None = None,
           ttl: float = 10) -> ExecutionGrant:
    issued = env.coordinator.issue_grant(lease, scopes=scopes or ["tool:run"], ttl=ttl)
    assert issued.grant is not None, issued
    return issued.grant


def _validate(env: Env, grant: Any, scopes: list[str] | None = None,
              identity: LeaseIdentity = IDENT) -> Callable[[], Any]:
    return lambda: env.coordinator.validate(grant, identity=identity,
                                            scopes=scopes or ["tool:run"])


A, H, T, R, G, V = (LifecycleEvent.ACQUIRE, LifecycleEvent.HEARTBEAT, LifecycleEvent.TAKEOVER,
                    LifecycleEvent.RELEASE, LifecycleEvent.GRANT_ISSUE,
                    LifecycleEvent.GRANT_VALIDATE)


def _lease_held() -> list[Provoked]:
    env = make_env()
    env.acquire()
    return [_provoke(env, A, None, "conn-b", lambda: env.coordinator.acquire(
        IDENT, "conn-b", scopes=SCOPES, ttl=10), current_epoch=1),
        _provoke(env, A, None, "conn-a", lambda: env.coordinator.acquire(
            IDENT, "conn-a", scopes=SCOPES, ttl=10), current_epoch=1)]


def _takeover_required() -> list[Provoked]:
    expired, released = make_env(), make_env()
    expire(expired, expired.acquire())
    assert released.coordinator.release(released.acquire()).ok
    return [_acquire_again(env, who) for env in (expired, released)
            for who in ("conn-a", "conn-b")]


def _acquire_again(env: Env, who: str) -> Provoked:
    return _provoke(env, A, None, who, lambda: env.coordinator.acquire(
        IDENT, who, scopes=SCOPES, ttl=10), current_epoch=1)


def _lease_missing() -> list[Provoked]:
    env = make_env()
    ghost = LeaseHandle(IDENT, "conn-a", UUID(int=42), 1, SCOPES, env.clock.now())
    c = env.coordinator
    return [
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(ghost, ttl=10)),
        _provoke(env, R, 1, "conn-a", lambda: c.release(ghost)),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(ghost, scopes=[], ttl=5)),
        _provoke(env, T, 3, "conn-b", lambda: c.takeover(
            IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=3)),
    ]


def _every_holder_call(env: Env, beating: LeaseHandle, closing: LeaseHandle,
                       grant: ExecutionGrant) -> list[Provoked]:
    """Heartbeat ``beating``, release and issue a grant on ``closing``, and validate
    ``grant``: every call a holder of conn-a at epoch 1 makes, each provoking the reason."""
    c = env.coordinator
    return [
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(beating, ttl=10), current_epoch=1),
        _provoke(env, R, 1, "conn-a", lambda: c.release(closing), current_epoch=1),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(closing, scopes=[], ttl=5)),
        _provoke(env, V, 1, "conn-a", _validate(env, grant)),
    ]


def _lease_expired() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire(ttl=30)
    grant = _grant(env, lease, ttl=20)
    # Shorten the lease below the grant's expiry: the grant is alive, its lease is not.
    short = c.heartbeat(lease, ttl=5).lease
    assert short is not None
    env.clock.advance(6)
    return _every_holder_call(env, lease, short, grant)


def _lease_released() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    grant = _grant(env, lease)
    assert c.release(lease).ok
    return _every_holder_call(env, lease, lease, grant)


def _lease_replaced() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    grant = _grant(env, lease)
    other_id = attrs.evolve(lease, lease_id=UUID(int=7))
    other_conn = attrs.evolve(lease, connector_id="conn-x")
    provoked = [
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(other_id, ttl=10), current_epoch=1),
        _provoke(env, R, 1, "conn-x", lambda: c.release(other_conn), current_epoch=1),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(other_id, scopes=[], ttl=5)),
        _provoke(env, H, 1, "conn-x", lambda: c.heartbeat(other_conn, ttl=10),
                 current_epoch=1),
    ]
    # Same epoch, different lease id in the durable row (a store in a state no public call
    # reaches): the grant names a lease that is no longer current.
    put_row(env.store, attrs.evolve(row_of(env.store), lease_id=UUID(int=8)))
    provoked.append(_provoke(env, V, 1, "conn-a", _validate(env, grant)))
    return provoked


def _stale_epoch() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    grant = _grant(env, lease)
    assert c.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1).ok
    return [
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(lease, ttl=10), current_epoch=2),
        _provoke(env, R, 1, "conn-a", lambda: c.release(lease), current_epoch=2),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(lease, scopes=[], ttl=5)),
        _provoke(env, V, 1, "conn-a", _validate(env, grant)),
    ]


def _epoch_mismatch() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    expire(env, lease)
    future = attrs.evolve(lease, epoch=2)
    return [
        _provoke(env, T, 5, "conn-b", lambda: c.takeover(
            IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=5), current_epoch=1),
        _provoke(env, H, 2, "conn-a", lambda: c.heartbeat(future, ttl=10), current_epoch=1),
        _provoke(env, R, 2, "conn-a", lambda: c.release(future), current_epoch=1),
    ]


def _epoch_exhausted() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    entry = AuditEntry(UUID(int=99), A, Outcome.ACQUIRED, None, IDENT, "conn-a", 1, "seed")
    outcome = env.store.apply(Insert(IDENT, UUID(int=98), "conn-a", SCOPES,
                                     timedelta(seconds=10)), entry)
    assert outcome.row is not None
    put_row(env.store, attrs.evolve(outcome.row, epoch=MAX_EPOCH))
    active = [_provoke(env, T, MAX_EPOCH, "conn-b", lambda: c.takeover(
        IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=MAX_EPOCH),
        current_epoch=MAX_EPOCH)]  # AllowAllPolicy preempts, still refused
    env.clock.advance(10)
    expired = [_provoke(env, T, MAX_EPOCH, "conn-b", lambda: c.takeover(
        IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=MAX_EPOCH),
        current_epoch=MAX_EPOCH)]
    assert row_of(env.store).epoch == MAX_EPOCH
    assert row_of(env.store).connector_id == "conn-a"
    return active + expired


def _policy_denied() -> list[Provoked]:
    """The production default (no policy given) denies every lease and grant operation."""
    env = make_env()
    lease = env.acquire()
    deny = ConnectorLeaseCoordinator(env.store, id_source=CountingIds())
    other = ConnectorLeaseCoordinator(env.store, StaticConnectorPolicy.from_dict(
        {"rules": [{"tenant_id": "acme", "logical_agent_id": "*", "binding_id": "*",
                    "connector_id": "conn-a", "scopes": ["tool:run"], "max_lease_ttl": 60,
                    "max_grant_ttl": 10}]}), id_source=CountingIds())
    expire(env, lease)
    before = env.rows()
    provoked = [
        _provoke(env, A, None, "conn-b", lambda: deny.acquire(
            OTHER_IDENT, "conn-b", scopes=SCOPES, ttl=10), identity=OTHER_IDENT),
        _provoke(env, T, 1, "conn-b", lambda: deny.takeover(
            IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1)),
        _provoke(env, H, 1, "conn-a", lambda: deny.heartbeat(lease, ttl=10)),
        _provoke(env, R, 1, "conn-a", lambda: deny.release(lease)),
        _provoke(env, G, 1, "conn-a", lambda: deny.issue_grant(lease, scopes=[], ttl=5)),
        # A configured policy with no matching rule also says policy_denied.
        _provoke(env, A, None, "conn-z", lambda: other.acquire(
            OTHER_IDENT, "conn-z", scopes=[], ttl=10), identity=OTHER_IDENT),
    ]
    assert env.rows() == before
    return provoked


def _preemption_denied() -> list[Provoked]:
    env = make_env(StaticConnectorPolicy.from_dict({"rules": [
        {"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*", "connector_id": "*",
         "scopes": list(SCOPES), "max_lease_ttl": 60, "max_grant_ttl": 10}]}))
    env.acquire()
    provoked = [_provoke(env, T, 1, "conn-b", lambda: env.coordinator.takeover(
        IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1))]
    assert row_of(env.store).connector_id == "conn-a"
    return provoked


_NARROW = {"rules": [{"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*",
                      "connector_id": "*", "scopes": ["tool:read"], "max_lease_ttl": 60,
                      "max_grant_ttl": 10}]}


def _scope_not_authorized() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire(scopes=["tool:run"])
    grant = _grant(env, lease, ["tool:run"])
    provoked = [
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(
            lease, scopes=["tool:run", "tool:admin"], ttl=5)),
        _provoke(env, V, 1, "conn-a", _validate(env, grant, ["tool:run", "tool:read"])),
    ]
    # The lease's scopes no longer cover the grant's (same lease id and epoch).
    put_row(env.store, attrs.evolve(row_of(env.store), scopes=("tool:read",)))
    provoked.append(_provoke(env, V, 1, "conn-a", _validate(env, grant, ["tool:run"])))
    static = make_env(StaticConnectorPolicy.from_dict(_NARROW))
    provoked.append(_provoke(static, A, None, "conn-a", lambda: static.coordinator.acquire(
        IDENT, "conn-a", scopes=["tool:run"], ttl=10)))
    return provoked


def _ttl_not_authorized() -> list[Provoked]:
    env = make_env(StaticConnectorPolicy.from_dict(_NARROW))
    c = env.coordinator
    lease = env.acquire(scopes=["tool:read"], ttl=60)
    return [
        _provoke(env, A, None, "conn-b", lambda: c.acquire(
            OTHER_IDENT, "conn-b", scopes=["tool:read"], ttl=61), identity=OTHER_IDENT),
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(lease, ttl=60.5)),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(
            lease, scopes=["tool:read"], ttl=11)),
    ]


def _grant_unknown() -> list[Provoked]:
    env = make_env()
    lease = env.acquire()
    grant = _grant(env, lease)
    forged = attrs.evolve(grant)
    restarted = env.restart()
    return [
        _provoke(env, V, None, "unrecognized", _validate(env, forged)),
        _provoke(env, V, None, "unrecognized", _validate(env, "not a grant")),
        _provoke(env, V, None, "unrecognized", lambda: restarted.validate(
            grant, identity=IDENT, scopes=["tool:run"])),
    ]


def _grant_expired() -> list[Provoked]:
    env = make_env()
    lease = env.acquire()
    grant = _grant(env, lease, ttl=5)
    env.clock.advance(5)  # expiry is inclusive: expires_at <= now is expired
    return [_provoke(env, V, 1, "conn-a", _validate(env, grant))]


def _mismatch(target: LeaseIdentity) -> list[Provoked]:
    env = make_env()
    grant = _grant(env, env.acquire())
    env.acquire(target, "conn-t")
    return [_provoke(env, V, 1, "conn-a", _validate(env, grant, identity=target),
                     identity=target)]


def _store_unavailable() -> list[Provoked]:
    env = make_env()
    faulty = FaultyStore(env.store)
    coordinator = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=env.ids)
    lease = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10).lease
    assert lease is not None
    issued = coordinator.issue_grant(lease, scopes=["tool:run"], ttl=5)
    assert issued.grant is not None
    faulty.fail_load = True
    return [_provoke(env, V, 1, "conn-a", lambda: coordinator.validate(
        issued.grant, identity=IDENT, scopes=["tool:run"]))]  # type: ignore[arg-type]


SCENARIOS: dict[Reason, Callable[[], list[Provoked]]] = {
    Reason.LEASE_HELD: _lease_held,
    Reason.TAKEOVER_REQUIRED: _takeover_required,
    Reason.LEASE_MISSING: _lease_missing,
    Reason.LEASE_EXPIRED: _lease_expired,
    Reason.LEASE_RELEASED: _lease_released,
    Reason.LEASE_REPLACED: _lease_replaced,
    Reason.STALE_EPOCH: _stale_epoch,
    Reason.EPOCH_MISMATCH: _epoch_mismatch,
    Reason.EPOCH_EXHAUSTED: _epoch_exhausted,
    Reason.POLICY_DENIED: _policy_denied,
    Reason.PREEMPTION_DENIED: _preemption_denied,
    Reason.SCOPE_NOT_AUTHORIZED: _scope_not_authorized,
    Reason.TTL_NOT_AUTHORIZED: _ttl_not_authorized,
    Reason.GRANT_UNKNOWN: _grant_unknown,
    Reason.GRANT_EXPIRED: _grant_expired,
    Reason.TENANT_MISMATCH: lambda: _mismatch(LeaseIdentity("other", "agent-1", "binding-1")),
    Reason.AGENT_MISMATCH: lambda: _mismatch(LeaseIdentity("acme", "agent-2", "binding-1")),
    Reason.BINDING_MISMATCH: lambda: _mismatch(LeaseIdentity("acme", "agent-1", "binding-9")),
    Reason.STORE_UNAVAILABLE: _store_unavailable,
}


def test_every_reason_is_provoked_for_real() -> None:
    provoked = {p.reason for scenario in SCENARIOS.values() for p in scenario()}
    assert provoked == set(Reason)


@pytest.mark.parametrize("reason", list(Reason), ids=str)
def test_denial_reason_and_its_audit_row(reason: Reason) -> None:
    attempts = SCENARIOS[reason]()
    assert attempts
    for p in attempts:
        assert p.reason is reason, p
        assert p.current_epoch == p.expected_current_epoch, p
        assert len(p.rows) == 1, f"{p.event} {reason}: {len(p.rows)} audit rows"
        entry = p.rows[0].entry
        assert entry.event is p.event
        assert entry.outcome is Outcome.DENIED
        assert entry.reason is reason
        assert entry.epoch == p.epoch
        assert entry.connector_id == p.connector_id
        assert entry.identity == p.identity


def test_store_down_entirely_validation_still_fails_closed() -> None:
    env = make_env()
    faulty = FaultyStore(env.store)
    coordinator = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=env.ids)
    lease = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10).lease
    assert lease is not None
    grant = coordinator.issue_grant(lease, scopes=["tool:run"], ttl=5).grant
    assert grant is not None
    faulty.fail_load = faulty.fail_record = True
    calls: list[ConnectorExecutionContext] = []
    result = coordinator.invoke(grant, calls.append, identity=IDENT, scopes=["tool:run"])
    assert result.reason is Reason.STORE_UNAVAILABLE
    assert calls == []
    faulty.fail_load = faulty.fail_record = False
    assert coordinator.validate(grant, identity=IDENT, scopes=["tool:run"]).ok


def test_lifecycle_store_failure_raises_store_unavailable() -> None:
    env = make_env()
    faulty = FaultyStore(env.store)
    coordinator = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=env.ids)
    faulty.fail_load = True
    with pytest.raises(StoreUnavailable):
        coordinator.takeover(IDENT, "conn-a", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert env.state() == ([], [])


# --- lifecycle semantics ---------------------------------------------------------------------


def test_acquire_gives_epoch_one_and_store_time_expiry() -> None:
    env = make_env()
    result = env.coordinator.acquire(IDENT, "conn-a", scopes=["b", "a", "b"], ttl=30,
                                     correlation_id="req-1")
    assert result.outcome is Outcome.ACQUIRED
    assert result.ok and result.reason is None and not result.reconciled
    assert result.correlation_id == "req-1"
    lease = result.lease
    assert lease is not None
    assert lease.epoch == 1 and result.current_epoch == 1
    assert lease.scopes == ("a", "b")
    assert lease.expires_at == env.clock.now() + timedelta(seconds=30)
    row = row_of(env.store)
    assert LeaseHandle.of(row) == lease
    assert row.acquired_at == row.heartbeat_at == row.updated_at == env.clock.now()
    assert row.released_at is None


def test_takeover_increments_by_one_and_rotates_the_lease_id() -> None:
    env = make_env()
    lease = env.acquire()
    seen_ids = {lease.lease_id}
    current = lease
    for expected in range(1, 30):
        result = env.coordinator.takeover(IDENT, f"conn-{expected % 3}", scopes=SCOPES,
                                          ttl=10, expected_epoch=expected)
        assert result.outcome is Outcome.TAKEN_OVER
        assert result.lease is not None
        assert result.lease.epoch == expected + 1 == current.epoch + 1
        assert result.lease.lease_id not in seen_ids
        seen_ids.add(result.lease.lease_id)
        current = result.lease
    assert row_of(env.store).epoch == 30
    assert len(env.rows()) == 1


def test_release_keeps_the_epoch_and_only_takeover_follows() -> None:
    env = make_env()
    lease = env.acquire()
    taken = env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10,
                                     expected_epoch=1).lease
    assert taken is not None
    released = env.coordinator.release(taken)
    assert released.outcome is Outcome.RELEASED
    assert released.lease is not None and released.lease.epoch == 2
    row = row_of(env.store)
    assert row.epoch == 2 and row.state(env.clock.now()) is LeaseState.RELEASED
    assert row.released_at == env.clock.now()
    again = env.coordinator.takeover(IDENT, "conn-a", scopes=SCOPES, ttl=10, expected_epoch=2)
    assert again.lease is not None and again.lease.epoch == 3
    assert lease.epoch == 1


@pytest.mark.parametrize("how", ["expired", "released"])
def test_nothing_but_takeover_revives_a_dead_lease(how: str) -> None:
    env = make_env()
    lease = env.acquire(ttl=10)
    if how == "expired":
        expire(env, lease)
        dead = Reason.LEASE_EXPIRED
    else:
        assert env.coordinator.release(lease).ok
        dead = Reason.LEASE_RELEASED
    frozen = row_of(env.store)
    c = env.coordinator
    assert c.heartbeat(lease, ttl=10).reason is dead
    assert c.release(lease).reason is dead
    assert c.issue_grant(lease, scopes=[], ttl=5).reason is dead
    for who in ("conn-a", "conn-b"):
        assert c.acquire(IDENT, who, scopes=SCOPES, ttl=10).reason is Reason.TAKEOVER_REQUIRED
    assert row_of(env.store) == frozen
    revived = c.takeover(IDENT, "conn-a", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert revived.ok and revived.lease is not None and revived.lease.epoch == 2


def test_heartbeat_moves_expiry_to_store_time_plus_ttl() -> None:
    env = make_env()
    lease = env.acquire(ttl=10)
    env.clock.advance(9)
    result = env.coordinator.heartbeat(lease, ttl=timedelta(seconds=20))
    assert result.outcome is Outcome.RENEWED and result.lease is not None
    assert result.lease.expires_at == env.clock.now() + timedelta(seconds=20)
    assert result.lease.epoch == 1 and result.lease.lease_id == lease.lease_id
    row = row_of(env.store)
    assert row.heartbeat_at == env.clock.now()
    assert row.acquired_at == env.clock.now() - timedelta(seconds=9)
    # The original handle still names the lease: heartbeat matches identity, not expiry.
    env.clock.advance(15)
    assert env.coordinator.heartbeat(lease, ttl=5).ok


def test_expiry_is_judged_by_the_store_clock_not_the_wall_clock() -> None:
    # The store lives in 2001: by the wall clock this lease expired decades ago.
    env = make_env(start=datetime(2001, 1, 1, tzinfo=UTC))
    lease = env.acquire(ttl=10)
    assert lease.expires_at < datetime.now(UTC)
    env.clock.advance(timedelta(seconds=9, microseconds=999_999))
    assert env.coordinator.heartbeat(lease, ttl=10).ok
    grant = _grant(env, lease, ttl=5)
    assert env.coordinator.validate(grant, identity=IDENT, scopes=["tool:run"]).ok
    # And in the far future: the store says expired although no wall time has passed.
    future = make_env(start=datetime(2999, 1, 1, tzinfo=UTC))
    far = future.acquire(ttl=10)
    future.clock.advance(10)
    assert future.coordinator.heartbeat(far, ttl=10).reason is Reason.LEASE_EXPIRED


def test_denials_report_the_current_epoch() -> None:
    env = make_env()
    env.acquire()
    c = env.coordinator
    assert c.takeover(IDENT, "b", scopes=SCOPES, ttl=10, expected_epoch=1).current_epoch == 2
    assert c.acquire(IDENT, "c", scopes=SCOPES, ttl=10).current_epoch == 2
    assert c.takeover(IDENT, "c", scopes=SCOPES, ttl=10, expected_epoch=9).current_epoch == 2
    assert c.takeover(OTHER_IDENT, "c", scopes=SCOPES, ttl=10,
                      expected_epoch=1).current_epoch is None
    deny = ConnectorLeaseCoordinator(env.store, id_source=CountingIds())
    assert deny.acquire(IDENT, "c", scopes=SCOPES, ttl=10).current_epoch is None


def test_takeover_fences_every_old_grant_and_handle() -> None:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    grants = [_grant(env, lease, [scope], ttl=30) for scope in SCOPES]
    for grant in grants:
        assert c.validate(grant, identity=IDENT, scopes=grant.scopes).ok
    taken = c.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert taken.lease is not None
    for grant in grants:
        assert c.validate(grant, identity=IDENT, scopes=grant.scopes).reason is (
            Reason.STALE_EPOCH)
        calls: list[ConnectorExecutionContext] = []
        assert c.invoke(grant, calls.append, identity=IDENT,
                        scopes=grant.scopes).reason is Reason.STALE_EPOCH
        assert calls == []
    assert c.heartbeat(lease, ttl=10).reason is Reason.STALE_EPOCH
    assert c.release(lease).reason is Reason.STALE_EPOCH
    assert c.issue_grant(lease, scopes=[], ttl=5).reason is Reason.STALE_EPOCH
    fresh = _grant(env, taken.lease)
    assert c.validate(fresh, identity=IDENT, scopes=["tool:run"]).ok
    assert row_of(env.store).connector_id == "conn-b"


def test_correlation_ids_are_propagated_or_generated() -> None:
    env = make_env()
    given_id = env.coordinator.acquire(IDENT, "a", scopes=SCOPES, ttl=10, correlation_id="r-9")
    assert given_id.correlation_id == "r-9"
    assert env.audit()[-1].entry.correlation_id == "r-9"
    generated = env.coordinator.acquire(OTHER_IDENT, "a", scopes=SCOPES, ttl=10)
    assert generated.correlation_id and generated.correlation_id != "r-9"
    assert env.audit()[-1].entry.correlation_id == generated.correlation_id


def test_default_store_is_in_memory_and_default_policy_denies() -> None:
    coordinator = ConnectorLeaseCoordinator()
    result = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
    assert result.reason is Reason.POLICY_DENIED
    assert isinstance(coordinator.store, InMemoryLeaseStore)
    assert coordinator.store.leases() == []


# --- lost commits ----------------------------------------------------------------------------


def _faulty_env() -> tuple[Env, FaultyStore, ConnectorLeaseCoordinator]:
    env = make_env()
    faulty = FaultyStore(env.store)
    return env, faulty, ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=env.ids)


@pytest.mark.parametrize("when", ["before", "after"])
def test_lost_commit_is_reconciled_not_blindly_retried(when: str) -> None:
    env, faulty, coordinator = _faulty_env()
    faulty.lose_commit = when
    result = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
    assert result.ok and result.lease is not None
    assert result.lease.epoch == 1
    assert LeaseHandle.of(row_of(env.store)) == result.lease
    assert [r.entry.outcome for r in env.audit()] == [Outcome.ACQUIRED]
    assert coordinator.reconcile(IDENT, env.audit()[0].entry.event_id)
    assert not coordinator.reconcile(IDENT, UUID(int=123456))


def test_lost_takeover_commit_does_not_double_increment() -> None:
    env, faulty, coordinator = _faulty_env()
    assert coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10).ok
    faulty.lose_commit = "after"
    result = coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert result.ok and result.lease is not None and result.lease.epoch == 2
    assert row_of(env.store).epoch == 2
    assert [r.entry.outcome for r in env.audit()] == [Outcome.ACQUIRED, Outcome.TAKEN_OVER]


def test_reconciled_result_says_so() -> None:
    """``LeaseResult.reconciled`` is documented as true when the commit outcome was lost and
    established by rereading; the coordinator never sets it."""
    _, faulty, coordinator = _faulty_env()
    faulty.lose_commit = "after"
    result = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
    assert result.ok
    assert result.reconciled is True
    assert coordinator.acquire(OTHER_IDENT, "conn-a", scopes=SCOPES, ttl=10).reconciled is False


def test_reconcile_checks_its_input() -> None:
    env = make_env()
    with pytest.raises(InvalidInput) as caught:
        env.coordinator.reconcile(IDENT, "not-a-uuid")  # type: ignore[arg-type]
    assert caught.value.field == "event_id"
    with pytest.raises(InvalidInput) as caught:
        env.coordinator.reconcile("x", UUID(int=1))  # type: ignore[arg-type]
    assert caught.value.field == "identity"


# --- racing threads on the memory store -------------------------------------------------------

THREADS = 8


def _race(env: Env, work: Callable[[ConnectorLeaseCoordinator, int], Any]) -> list[Any]:
    barrier = threading.Barrier(THREADS)
    results: list[Any] = [None] * THREADS
    gateways = [ConnectorLeaseCoordinator(env.store, AllowAllPolicy(), id_source=CountingIds())
                for _ in range(THREADS)]

    def run(i: int) -> None:
        barrier.wait()
        results[i] = work(gateways[i], i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(r is not None for r in results)
    return results


def test_racing_acquires_have_exactly_one_winner() -> None:
    for _ in range(20):
        env = make_env()
        results = _race(env, lambda c, i: c.acquire(IDENT, f"conn-{i}", scopes=SCOPES, ttl=10))
        winners = [r for r in results if r.ok]
        assert len(winners) == 1
        assert winners[0].lease.epoch == 1
        assert {r.reason for r in results if not r.ok} == {Reason.LEASE_HELD}
        assert row_of(env.store).connector_id == winners[0].lease.connector_id
        assert [r.entry.outcome for r in env.audit()].count(Outcome.ACQUIRED) == 1


def _takeover_at(epoch: int, c: ConnectorLeaseCoordinator, i: int) -> Any:
    return c.takeover(IDENT, f"conn-{i}", scopes=SCOPES, ttl=10, expected_epoch=epoch)


@pytest.mark.parametrize("active", [True, False], ids=["preempt-active", "expired"])
def test_racing_takeovers_have_exactly_one_winner_per_epoch(active: bool) -> None:
    env = make_env()
    env.acquire(ttl=10)
    for epoch in range(1, 11):
        if not active:
            env.clock.advance(10)  # the current lease has expired for every racer
        results = _race(env, functools.partial(_takeover_at, epoch))
        winners = [r for r in results if r.ok]
        assert len(winners) == 1, [r.reason for r in results]
        assert winners[0].lease.epoch == epoch + 1
        assert {r.reason for r in results if not r.ok} <= {Reason.EPOCH_MISMATCH}
        row = row_of(env.store)
        assert (row.epoch, row.lease_id) == (epoch + 1, winners[0].lease.lease_id)
    taken = [r.entry.epoch for r in env.audit() if r.entry.outcome is Outcome.TAKEN_OVER]
    assert taken == list(range(2, 12))


def test_an_acquire_that_commits_after_reconciliation_said_no_is_still_ours() -> None:
    """A lost acquire can commit on the server after the coordinator looked for its audit
    row; the lease row then carries our own lease id and the result must say acquired."""
    from mos_lease import CommitOutcomeUnknown
    from mos_lease.machine import write_outcome

    class LateCommit(InMemoryLeaseStore):
        def __init__(self) -> None:
            super().__init__(ManualClock())
            self.pending: tuple[Any, Any] | None = None

        def apply(self, write: Any, entry: Any) -> Any:
            if self.pending is None and entry.event.value == "acquire":
                self.pending = (write, entry)
                raise CommitOutcomeUnknown(entry.event_id, "reply lost")
            return super().apply(write, entry)

        def event_committed(self, event_id: Any) -> bool:
            answer = super().event_committed(event_id)
            if self.pending is not None:  # the in-flight insert lands just after we asked
                write, entry = self.pending
                assert write_outcome(write, None, self.clock.now()) is not None
                super().apply(write, entry)
            return answer

    store = LateCommit()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    result = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
    assert result.ok and result.reconciled
    assert result.lease is not None and result.lease.epoch == 1
    assert [r.entry.outcome for r in store.audit(IDENT)] == [Outcome.ACQUIRED]
