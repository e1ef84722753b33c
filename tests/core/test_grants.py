"""Execution grants: bounded by their lease, process-local, unforgeable, pruned by expiry."""

from __future__ import annotations

import copy
import os
import pickle
import sys
import threading
from datetime import datetime, timedelta, tzinfo
from typing import Any
from uuid import UUID

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mos_lease import (
    ConnectorExecutionContext,
    ExecutionGrant,
    LeaseHandle,
    LeaseIdentity,
    Outcome,
    Reason,
)
from mos_lease.errors import GrantNotTransferable
from mos_lease.vocabulary import LifecycleEvent
from tests.helpers import IDENT, SCOPES, Env, make_env


def _setup(lease_ttl: float = 60, grant_ttl: float = 10,
           scopes: list[str] | None = None) -> tuple[Env, LeaseHandle, ExecutionGrant]:
    env = make_env()
    lease = env.acquire(ttl=lease_ttl)
    issued = env.coordinator.issue_grant(lease, scopes=scopes or ["tool:run"], ttl=grant_ttl,
                                         correlation_id="req-7")
    assert issued.outcome is Outcome.GRANT_ISSUED and issued.grant is not None
    return env, lease, issued.grant


def _check(env: Env, grant: Any, scopes: list[str] | None = None) -> Reason | None:
    return env.coordinator.validate(grant, identity=IDENT, scopes=scopes or ["tool:run"]).reason


def test_a_grant_is_bound_to_everything_about_its_lease() -> None:
    env, lease, grant = _setup()
    assert grant.identity == lease.identity
    assert grant.connector_id == lease.connector_id
    assert grant.lease_id == lease.lease_id
    assert grant.epoch == lease.epoch == 1
    assert grant.scopes == ("tool:run",)
    assert grant.expires_at == env.clock.now() + timedelta(seconds=10)
    assert grant.correlation_id == "req-7"
    assert isinstance(grant.grant_id, UUID)
    assert env.coordinator.live_grants == 1
    last = env.audit()[-1].entry
    assert (last.event, last.outcome, last.reason, last.epoch) == (
        LifecycleEvent.GRANT_ISSUE, Outcome.GRANT_ISSUED, None, 1)


def test_grant_scopes_are_normalized_and_a_subset_works() -> None:
    env, _, grant = _setup(scopes=["tool:run", "tool:read", "tool:run"])
    assert grant.scopes == ("tool:read", "tool:run")
    result = env.coordinator.validate(grant, identity=IDENT, scopes=iter(["tool:read"]))
    assert result.ok and result.context is not None
    assert result.context.scopes == ("tool:read",)
    assert _check(env, grant, []) is None


def test_grant_expiry_never_goes_beyond_the_lease() -> None:
    env, lease, _ = _setup(lease_ttl=10)
    env.clock.advance(8)
    long = env.coordinator.issue_grant(lease, scopes=["tool:run"], ttl=30).grant
    assert long is not None
    assert long.expires_at == lease.expires_at
    # Renewing the lease afterwards does not stretch a grant already minted.
    renewed = env.coordinator.heartbeat(lease, ttl=60).lease
    assert renewed is not None and renewed.expires_at > long.expires_at
    context = env.coordinator.validate(long, identity=IDENT, scopes=["tool:run"]).context
    assert context is not None and context.expires_at == long.expires_at
    env.clock.advance(2)
    assert _check(env, long) is Reason.GRANT_EXPIRED


@settings(max_examples=60, deadline=None)
@given(lease_ttl=st.integers(1, 300_000), elapsed=st.integers(0, 300_000),
       grant_ttl=st.integers(1, 30_000))
def test_grant_expiry_is_the_earlier_of_ttl_and_lease(lease_ttl: int, elapsed: int,
                                                      grant_ttl: int) -> None:
    env = make_env()
    lease = env.acquire(ttl=timedelta(milliseconds=lease_ttl))
    env.clock.advance(timedelta(milliseconds=elapsed))
    issued = env.coordinator.issue_grant(lease, scopes=[], ttl=timedelta(milliseconds=grant_ttl))
    if elapsed >= lease_ttl:
        assert issued.reason is Reason.LEASE_EXPIRED
        return
    assert issued.grant is not None
    assert issued.grant.expires_at == min(env.clock.now() + timedelta(milliseconds=grant_ttl),
                                          lease.expires_at)
    context = env.coordinator.validate(issued.grant, identity=IDENT, scopes=[]).context
    assert context is not None
    assert context.expires_at <= lease.expires_at


def test_context_expiry_is_the_earlier_of_grant_and_lease() -> None:
    env, lease, _ = _setup(lease_ttl=60, grant_ttl=20)
    grant = env.coordinator.issue_grant(lease, scopes=["tool:run"], ttl=20).grant
    assert grant is not None
    shortened = env.coordinator.heartbeat(lease, ttl=5).lease
    assert shortened is not None
    context = env.coordinator.validate(grant, identity=IDENT, scopes=["tool:run"]).context
    assert context is not None
    assert context.expires_at == shortened.expires_at < grant.expires_at


# --- not transferable ------------------------------------------------------------------------


@pytest.mark.parametrize("how", [
    pytest.param(copy.copy, id="copy"),
    pytest.param(copy.deepcopy, id="deepcopy"),
    pytest.param(lambda g: copy.deepcopy([g]), id="deepcopy-in-list"),
    *[pytest.param(lambda g, p=p: pickle.dumps(g, protocol=p), id=f"pickle-{p}")
      for p in range(pickle.HIGHEST_PROTOCOL + 1)],
])
def test_grants_cannot_be_copied_or_pickled(how: Any) -> None:
    env, _, grant = _setup()
    with pytest.raises(GrantNotTransferable):
        how(grant)
    assert issubclass(GrantNotTransferable, TypeError)
    assert _check(env, grant) is None  # the original is untouched


def test_a_grant_result_cannot_be_deep_copied_either() -> None:
    env = make_env()
    issued = env.coordinator.issue_grant(env.acquire(), scopes=[], ttl=5)
    with pytest.raises(GrantNotTransferable):
        copy.deepcopy(issued)


def test_grant_equality_is_object_identity() -> None:
    _, _, grant = _setup()
    twin = attrs.evolve(grant)
    assert grant == grant  # noqa: PLR0124
    assert twin != grant
    assert attrs.astuple(twin) == attrs.astuple(grant)


def _hand_built(grant: ExecutionGrant, cls: type[ExecutionGrant] = ExecutionGrant,
                **changes: object) -> ExecutionGrant:
    forged = cls.__new__(cls)
    for field in attrs.fields(ExecutionGrant):
        object.__setattr__(forged, field.name, changes.get(field.name,
                                                           getattr(grant, field.name)))
    return forged


class _Sub(ExecutionGrant):
    pass


FORGERIES: dict[str, Any] = {
    "evolve-identical": attrs.evolve,
    "evolve-epoch": lambda g: attrs.evolve(g, epoch=2),
    "evolve-scopes": lambda g: attrs.evolve(g, scopes=SCOPES),
    "hand-built-identical": _hand_built,
    "hand-built-subclass": lambda g: _hand_built(g, _Sub),
    "hand-built-longer-expiry": lambda g: _hand_built(
        g, expires_at=g.expires_at + timedelta(hours=1)),
}


@pytest.mark.parametrize("forge", FORGERIES.values(), ids=FORGERIES.keys())
def test_forged_grants_are_unknown(forge: Any) -> None:
    env, _, grant = _setup()
    forged = forge(grant)
    assert forged is not grant
    calls: list[object] = []
    result = env.coordinator.invoke(forged, calls.append, identity=IDENT, scopes=["tool:run"])
    assert result.reason is Reason.GRANT_UNKNOWN
    assert calls == [] and result.value is None and result.context is None
    entry = env.audit()[-1].entry
    assert (entry.event, entry.outcome, entry.reason) == (
        LifecycleEvent.GRANT_VALIDATE, Outcome.DENIED, Reason.GRANT_UNKNOWN)
    assert entry.connector_id == "unrecognized" and entry.epoch is None
    assert _check(env, grant) is None


@pytest.mark.parametrize(("field", "value"), [
    ("epoch", 2),
    ("scopes", ("tool:run", "tool:admin")),
    ("expires_at", None),  # set below to an hour later
    ("connector_id", "conn-evil"),
    ("lease_id", UUID(int=5)),
    ("identity", LeaseIdentity("acme", "agent-1", "binding-2")),
    ("correlation_id", "req-evil"),
])
def test_tampering_with_the_real_grant_object_is_refused(field: str, value: object) -> None:
    env, _, grant = _setup()
    if field == "expires_at":
        value = grant.expires_at + timedelta(hours=1)
    object.__setattr__(grant, field, value)
    target = value if isinstance(value, LeaseIdentity) else IDENT
    result = env.coordinator.validate(grant, identity=target, scopes=["tool:run"])
    assert result.reason is Reason.GRANT_UNKNOWN


MALFORMED_TAMPERING: dict[str, tuple[str, object]] = {
    "scopes-not-iterable": ("scopes", 5),
    "scopes-non-str": ("scopes", (5,)),
    "identity-a-str": ("identity", "acme/agent-1/binding-1"),
    "connector-an-int": ("connector_id", 5),
    "expires-a-str": ("expires_at", "2030-01-01"),
    "correlation-none": ("correlation_id", None),
    "mac-a-str": ("_mac", "not bytes"),
}


def test_tampering_with_wrongly_typed_values_is_refused_not_a_crash() -> None:
    """A grant whose fields were overwritten with values of the wrong type, or a bare
    ``ExecutionGrant.__new__`` with no fields at all, must be refused like any forgery:
    ``grant_unknown``, one audit row, adapter not called; never AttributeError/TypeError
    escaping from ``validate``/``invoke``."""
    problems = []
    for name in [*MALFORMED_TAMPERING, "bare-new"]:
        env, _, grant = _setup()
        if name == "bare-new":
            forged = ExecutionGrant.__new__(ExecutionGrant)
        else:
            field, value = MALFORMED_TAMPERING[name]
            object.__setattr__(grant, field, value)
            forged = grant
        calls: list[object] = []
        before = len(env.audit())
        try:
            result = env.coordinator.invoke(forged, calls.append, identity=IDENT,
                                            scopes=["tool:run"])
        except Exception as crash:  # the point is that nothing escapes
            problems.append(f"{name}: {type(crash).__name__}: {crash}")
            continue
        if result.reason is not Reason.GRANT_UNKNOWN or calls or len(env.audit()) != before + 1:
            problems.append(f"{name}: {result.reason} calls={len(calls)}")
    assert problems == []


def test_a_grant_from_another_coordinator_on_the_same_store_is_unknown() -> None:
    env, _, grant = _setup()
    other = env.restart()
    assert other.validate(grant, identity=IDENT, scopes=["tool:run"]).reason is (
        Reason.GRANT_UNKNOWN)
    assert _check(env, grant) is None


def test_a_gateway_restart_invalidates_grants_but_not_the_lease() -> None:
    env, lease, grant = _setup()
    restarted = env.restart()
    assert restarted.live_grants == 0
    assert restarted.validate(grant, identity=IDENT, scopes=["tool:run"]).reason is (
        Reason.GRANT_UNKNOWN)
    fresh = restarted.issue_grant(lease, scopes=["tool:run"], ttl=10)
    assert fresh.grant is not None
    assert fresh.grant.epoch == lease.epoch and fresh.grant.lease_id == lease.lease_id
    assert restarted.validate(fresh.grant, identity=IDENT, scopes=["tool:run"]).ok
    # ... and the fresh grant is just as foreign to the old process.
    assert _check(env, fresh.grant) is Reason.GRANT_UNKNOWN


def test_an_expired_grant_stays_refused_after_the_registry_dropped_it() -> None:
    env, lease, grant = _setup(grant_ttl=5)
    env.clock.advance(5)
    assert _check(env, grant) is Reason.GRANT_EXPIRED
    assert env.coordinator.live_grants == 0
    assert env.coordinator.issue_grant(lease, scopes=[], ttl=5).ok  # prunes again
    assert _check(env, grant) is Reason.GRANT_EXPIRED


def test_the_registry_is_bounded_by_expiry() -> None:
    env = make_env()
    lease = env.acquire(ttl=300)
    peak = 0
    step = timedelta(milliseconds=10)
    for i in range(20_000):
        issued = env.coordinator.issue_grant(lease, scopes=[], ttl=timedelta(milliseconds=50))
        assert issued.ok
        env.clock.advance(step)
        peak = max(peak, env.coordinator.live_grants)
        if i % 5_000 == 4_999:
            renewed = env.coordinator.heartbeat(lease, ttl=300)
            assert renewed.ok
    assert peak <= 6
    assert env.coordinator.live_grants <= 6


# --- invoke ----------------------------------------------------------------------------------


def test_invoke_calls_the_adapter_once_with_only_the_context() -> None:
    env, lease, grant = _setup(scopes=["tool:run", "tool:read"])
    calls: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def adapter(*args: object, **kwargs: object) -> str:
        calls.append((args, kwargs))
        return "payload"

    result = env.coordinator.invoke(grant, adapter, identity=IDENT,
                                    scopes=["tool:run", "tool:run"])
    assert result.ok and result.value == "payload"
    assert len(calls) == 1
    (args, kwargs), = calls
    assert kwargs == {} and len(args) == 1
    context = args[0]
    assert type(context) is ConnectorExecutionContext
    assert context == result.context
    assert context == ConnectorExecutionContext(
        identity=IDENT, connector_id=lease.connector_id, lease_id=lease.lease_id, epoch=1,
        scopes=("tool:run",), expires_at=grant.expires_at, correlation_id="req-7")
    # The context is plain data: no grant, no store, no coordinator inside.
    assert not any(isinstance(getattr(context, f.name), ExecutionGrant)
                   for f in attrs.fields(ConnectorExecutionContext))


@pytest.mark.parametrize("spoil", ["expire", "release", "takeover", "scope", "identity"])
def test_invoke_never_calls_the_adapter_on_denial(spoil: str) -> None:
    env, lease, grant = _setup()
    scopes, identity = ["tool:run"], IDENT
    if spoil == "expire":
        env.clock.advance(10)
    elif spoil == "release":
        assert env.coordinator.release(lease).ok
    elif spoil == "takeover":
        assert env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10,
                                        expected_epoch=1).ok
    elif spoil == "scope":
        scopes = ["tool:read"]
    else:
        identity = LeaseIdentity("acme", "agent-2", "binding-1")
    calls: list[ConnectorExecutionContext] = []
    result = env.coordinator.invoke(grant, calls.append, identity=identity, scopes=scopes)
    assert not result.ok and result.reason is not None
    assert calls == [] and result.context is None and result.value is None


# --- fork ------------------------------------------------------------------------------------


def test_a_forked_child_refuses_grants_inherited_from_its_parent() -> None:
    env, _, grant = _setup()
    coordinator = env.coordinator
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 70
        try:
            os.close(read_end)
            calls: list[object] = []
            checked = coordinator.validate(grant, identity=IDENT, scopes=["tool:run"])
            invoked = coordinator.invoke(grant, calls.append, identity=IDENT,
                                         scopes=["tool:run"])
            # Below the process check, the inherited registry itself was wiped at fork.
            registry = coordinator._run(coordinator._flows.validate(
                grant, IDENT, ["tool:run"], None), "validate")
            report = (f"{checked.reason}|{invoked.reason}|{len(calls)}|"
                      f"{coordinator.live_grants}|{registry.reason}")
            os.write(write_end, report.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert report == "grant_unknown|grant_unknown|0|0|grant_unknown"
    # The parent still holds a working grant.
    assert _check(env, grant) is None
    assert coordinator.live_grants == 1


def test_the_registry_survives_threads_sharing_one_coordinator() -> None:
    """One coordinator per gateway process means one coordinator shared by the gateway's
    threads. Minting and pruning must not corrupt the registry: no exception escapes and,
    once every grant has expired, nothing stays behind."""
    env = make_env()
    lease = env.acquire(ttl=300)
    coordinator = env.coordinator
    errors: list[str] = []
    done = threading.Event()

    def worker() -> None:
        try:
            for _ in range(1500):
                grant = coordinator.issue_grant(lease, scopes=[],
                                                ttl=timedelta(milliseconds=20)).grant
                if grant is not None:
                    coordinator.validate(grant, identity=IDENT, scopes=[])
        except Exception as crash:  # reported below, with the others
            errors.append(f"{type(crash).__name__}: {crash}")

    def ticker() -> None:
        for _ in range(200_000):  # at most 200 s of store time: the lease (300 s) outlives it
            if done.is_set():
                return
            env.clock.advance(timedelta(milliseconds=1))

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, as a loaded gateway would
    try:
        clock_thread = threading.Thread(target=ticker)
        clock_thread.start()
        workers = [threading.Thread(target=worker) for _ in range(8)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(timeout=60)
        done.set()
        clock_thread.join(timeout=10)
    finally:
        sys.setswitchinterval(previous)
    assert errors == []
    env.clock.advance(timedelta(seconds=1))
    assert coordinator.issue_grant(lease, scopes=[], ttl=5).ok  # prunes everything expired
    assert coordinator.live_grants == 1


# --- look-alike field types and hostile field values ---------------------------------------


class _Str(str):
    pass


class _Int(int):
    pass


class _Stamp(datetime):
    pass


class _Identity(LeaseIdentity):
    pass


def _identity_with(**fields: object) -> LeaseIdentity:
    """A hand-built identity (its constructor would normalize the fields)."""
    built = LeaseIdentity.__new__(LeaseIdentity)
    for field in attrs.fields(LeaseIdentity):
        object.__setattr__(built, field.name, fields.get(field.name, getattr(IDENT, field.name)))
    return built


def _look_alike(name: str, grant: ExecutionGrant) -> ExecutionGrant:
    """A hand-built grant in which one field is replaced by a value of another type that
    prints exactly like the real one, so the text the MAC covers is unchanged."""
    identity = grant.identity
    values: dict[str, object] = {
        "grant_id-str": str(grant.grant_id),
        "lease_id-str": str(grant.lease_id),
        "epoch-str": str(grant.epoch),
        "epoch-int-subclass": _Int(grant.epoch),
        "identity-subclass": _Identity(identity.tenant_id, identity.logical_agent_id,
                                       identity.binding_id),
        "identity-field-str-subclass": _identity_with(tenant_id=_Str(identity.tenant_id)),
        "connector_id-str-subclass": _Str(grant.connector_id),
        "scopes-list": list(grant.scopes),
        "scope-str-subclass": tuple(_Str(s) for s in grant.scopes),
        "expires_at-subclass": _Stamp.fromisoformat(grant.expires_at.isoformat()),
        "correlation_id-str-subclass": _Str(grant.correlation_id),
        "mac-bytearray": bytearray(grant._mac),
    }
    field = name.split("-", maxsplit=1)[0]
    field = {"mac": "_mac", "scope": "scopes"}.get(field, field)
    changes: dict[str, Any] = {field: values[name]}
    return _hand_built(grant, **changes)


LOOK_ALIKES = ["grant_id-str", "lease_id-str", "epoch-str", "epoch-int-subclass",
               "identity-subclass", "identity-field-str-subclass", "connector_id-str-subclass",
               "scopes-list", "scope-str-subclass", "expires_at-subclass",
               "correlation_id-str-subclass", "mac-bytearray"]


@pytest.mark.parametrize("dropped", [False, True], ids=["grant-live", "grant-dropped"])
@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_a_look_alike_of_another_type_is_unknown_not_expired(name: str, dropped: bool) -> None:
    """The MAC covers each field's text; a value of another type with the same text (the
    UUID's string, ``"1"`` for epoch 1, a subclass) must not pass for the minted value,
    whether the real grant is still live or was already dropped at its expiry."""
    env, _, grant = _setup(grant_ttl=5)
    forged = _look_alike(name, grant)
    if dropped:
        env.clock.advance(5)
        assert _check(env, grant) is Reason.GRANT_EXPIRED  # the real one: expired
    calls: list[object] = []
    result = env.coordinator.invoke(forged, calls.append, identity=IDENT, scopes=["tool:run"])
    assert result.reason is Reason.GRANT_UNKNOWN and calls == []
    entry = env.audit()[-1].entry
    assert (entry.reason, entry.connector_id) == (Reason.GRANT_UNKNOWN, "unrecognized")


class _Boom(Exception):
    pass


def _boom(*_args: object) -> Any:
    raise _Boom("hostile field")


class _Unhashable:
    __hash__ = _boom


class _Colliding:
    """Hashes like a live grant id, so the registry lookup has to call ``__eq__``."""

    def __init__(self, like: object) -> None:
        self._hash = hash(like)

    def __hash__(self) -> int:
        return self._hash

    __eq__ = _boom


class _Untouchable:
    __getattribute__ = _boom


class _Unprintable:
    __str__ = _boom
    __repr__ = _boom
    __format__ = _boom


class _RaisingIdentity(LeaseIdentity):
    @property
    def tenant_id(self) -> str:
        raise _Boom("property")


class _BadZone(tzinfo):
    utcoffset = _boom
    tzname = _boom
    dst = _boom


class _Unusable:
    __iter__ = _boom
    __len__ = _boom
    __eq__ = _boom
    __hash__ = _boom


HOSTILE: dict[str, Any] = {
    "grant_id-hash-raises": lambda g: {"grant_id": _Unhashable()},
    "grant_id-eq-raises": lambda g: {"grant_id": _Colliding(g.grant_id)},
    "grant_id-attribute-access-raises": lambda g: {"grant_id": _Untouchable()},
    "lease_id-str-raises": lambda g: {"lease_id": _Unprintable()},
    "epoch-str-raises": lambda g: {"epoch": _Unprintable()},
    "identity-property-raises": lambda g: {
        "identity": _RaisingIdentity.__new__(_RaisingIdentity)},
    "identity-attribute-access-raises": lambda g: {"identity": _Untouchable()},
    "scopes-iteration-raises": lambda g: {"scopes": _Unusable()},
    "expires_at-tzinfo-raises": lambda g: {
        "expires_at": g.expires_at.replace(tzinfo=_BadZone())},
    "correlation_id-everything-raises": lambda g: {"correlation_id": _Unusable()},
    "mac-everything-raises": lambda g: {"_mac": _Unusable()},
}


@pytest.mark.parametrize("dropped", [False, True], ids=["grant-live", "grant-dropped"])
@pytest.mark.parametrize("name", HOSTILE)
def test_a_grant_whose_fields_raise_is_refused_not_a_crash(name: str, dropped: bool) -> None:
    """Whatever a hand-built grant's fields raise, from hashing, comparing, printing or
    plain attribute access, ``validate`` refuses it ``grant_unknown`` and raises nothing."""
    env, _, grant = _setup(grant_ttl=5)
    forged = _hand_built(grant, **HOSTILE[name](grant))
    if dropped:
        env.clock.advance(5)
    calls: list[object] = []
    before = len(env.audit())
    result = env.coordinator.invoke(forged, calls.append, identity=IDENT, scopes=["tool:run"])
    assert result.reason is Reason.GRANT_UNKNOWN and calls == []
    assert len(env.audit()) == before + 1
    if not dropped:
        assert _check(env, grant) is None  # the real grant is unaffected
