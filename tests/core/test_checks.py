"""What the coordinator remembers of checked inputs (mos_lease/checks.py), as an attacker
would probe it: a remembered answer is only ever given for the very object, unchanged."""

from __future__ import annotations

import gc
import uuid
from datetime import UTC, datetime

import attrs
import pytest

from mos_lease import ConnectorLeaseCoordinator, ExecutionGrant
from mos_lease.checks import MAX_REMEMBERED, CheckedInputs
from mos_lease.errors import InvalidInput
from mos_lease.identity import LeaseIdentity
from mos_lease.records import LeaseHandle
from mos_lease.vocabulary import Reason
from tests.helpers import IDENT, make_env


def _grant_env() -> tuple[ConnectorLeaseCoordinator, ExecutionGrant]:
    env = make_env()
    lease = env.acquire(IDENT, scopes=("tool:run",))
    grant = env.coordinator.issue_grant(lease, scopes=("tool:run",), ttl=10).grant
    assert grant is not None
    return env.coordinator, grant


def test_an_identity_changed_behind_the_frozen_class_is_checked_again() -> None:
    coordinator, grant = _grant_env()
    target = LeaseIdentity(IDENT.tenant_id, IDENT.logical_agent_id, IDENT.binding_id)
    scopes = ("tool:run",)
    assert coordinator.validate(grant, identity=target, scopes=scopes).ok
    object.__setattr__(target, "tenant_id", "someone-else")
    assert coordinator.validate(
        grant, identity=target, scopes=scopes).reason is Reason.TENANT_MISMATCH
    object.__setattr__(target, "tenant_id", " padded")
    with pytest.raises(InvalidInput, match=r"identity\.tenant_id"):
        coordinator.validate(grant, identity=target, scopes=scopes)


def test_scopes_that_can_change_or_look_alike_borrow_no_answer() -> None:
    coordinator, grant = _grant_env()
    wanted = ["tool:run"]
    assert coordinator.validate(grant, identity=IDENT, scopes=wanted).ok
    wanted[0] = "tool:admin"  # a list may change between two calls
    assert coordinator.validate(
        grant, identity=IDENT, scopes=wanted).reason is Reason.SCOPE_NOT_AUTHORIZED

    class Liar(str):
        __slots__ = ()

        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return hash("tool:run")

    remembered = ("tool:run",)
    assert coordinator.validate(grant, identity=IDENT, scopes=remembered).ok
    assert coordinator.validate(
        grant, identity=IDENT, scopes=(Liar("tool:admin"),)
    ).reason is Reason.SCOPE_NOT_AUTHORIZED


def test_a_look_alike_identity_is_never_remembered_and_the_memory_holds_nothing_alive() -> None:
    class Sub(LeaseIdentity):
        __slots__ = ()

    inputs = CheckedInputs()
    sub = Sub("t", "a", "b")
    first = inputs.identity("identity", sub)
    assert type(first) is LeaseIdentity and first == LeaseIdentity("t", "a", "b")
    assert inputs.identity("identity", sub) is not first  # rebuilt each time
    plain = LeaseIdentity("t", "a", "b")
    assert inputs.identity("identity", plain) is inputs.identity("identity", plain)
    for i in range(3 * MAX_REMEMBERED):
        inputs.identity("identity", LeaseIdentity("t", "a", f"b{i}"))
        inputs.scopes("scopes", (f"s{i}",))
        inputs.scopes("scopes", frozenset({f"s{i}"}))
    gc.collect()
    # Every object checked in the loop is gone, and its entry with it: what is left is
    # `plain` and its checked copy.
    assert len(inputs._identities) <= 2
    assert len(inputs._scopes) == 0
    assert len(inputs._scope_texts) <= MAX_REMEMBERED
    checked = inputs.identity("identity", plain)
    del plain, checked
    gc.collect()
    assert len(inputs._identities) == 0


def test_a_plain_handle_is_its_own_answer_however_many() -> None:
    # A supervisor renews the handles its last heartbeat returned, thousands per tick: a
    # plain, normalized handle is checked but not rebuilt (a copy per lease per tick is
    # work for the garbage collector), and only identities are remembered.
    inputs = CheckedInputs()
    handles = [_handle(f"agent-{i}") for i in range(3 * MAX_REMEMBERED)]
    # Built by hand with an identity of the caller's: rebuilt once, with the checked one.
    first = [inputs.handle(handle) for handle in handles]
    assert not any(a is b for a, b in zip(first, handles, strict=True))
    assert all(inputs.handle(h) is h for h in first)
    unsorted = attrs.evolve(first[0], scopes=("tool:run", "a"))
    assert inputs.handle(unsorted) is not unsorted
    assert inputs.handle(unsorted).scopes == ("a", "tool:run")


def test_a_handle_changed_behind_the_frozen_class_is_checked_again() -> None:
    class Liar(str):
        __slots__ = ()

        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    inputs = CheckedInputs()
    handle = inputs.handle(_handle("agent"))
    assert inputs.handle(handle) is handle
    object.__setattr__(handle, "connector_id", Liar("someone-else"))
    rebuilt = inputs.handle(handle)
    assert rebuilt is not handle and type(rebuilt.connector_id) is str
    assert rebuilt.connector_id == "someone-else"
    # The identity inside is an object of its own: changing it is seen too.
    again = inputs.handle(rebuilt)
    assert again is rebuilt
    object.__setattr__(rebuilt.identity, "tenant_id", " padded")
    with pytest.raises(InvalidInput, match=r"lease\.identity\.tenant_id"):
        inputs.handle(rebuilt)


def _handle(agent: str) -> LeaseHandle:
    return LeaseHandle(identity=LeaseIdentity("t", agent, "b"), connector_id="conn",
                       lease_id=uuid.uuid4(), epoch=1, scopes=("tool:run",),
                       expires_at=datetime(2030, 1, 1, tzinfo=UTC))


def test_a_tuple_of_plain_strings_is_remembered_by_its_text_and_nothing_else_is() -> None:
    inputs = CheckedInputs()
    first = inputs.scopes("scopes", ("tool:run", "a"))
    assert first == ("a", "tool:run")
    # Another tuple of the same text (a row's scopes, read again): the same answer.
    given = ("tool:run", "a")
    again = tuple(scope for scope in given)  # another tuple object, same text
    assert again is not given
    assert inputs.scopes("scopes", again) is first

    class Text(str):
        __slots__ = ()

    look_alike = inputs.scopes("scopes", (Text("tool:run"), Text("a")))
    assert look_alike == first and look_alike is not first  # checked again, not borrowed
    with pytest.raises(InvalidInput):
        inputs.scopes("scopes", ("Tool Run",))
    with pytest.raises(InvalidInput):
        inputs.scopes("scopes", ("Tool Run",))  # a refusal is never remembered


def test_the_default_correlation_id_is_not_an_event_id() -> None:
    env = make_env()
    first = env.coordinator.acquire(IDENT, "conn-a", scopes=("tool:run",), ttl=60)
    assert first.lease is not None
    second = env.coordinator.heartbeat(first.lease, ttl=60)
    events = {record.entry.event_id.hex for record in env.store.audit()}
    correlations = {first.correlation_id, second.correlation_id}
    assert len(correlations) == 2
    assert not correlations & events
    assert {record.entry.correlation_id for record in env.store.audit()} == correlations


def test_the_handles_a_heartbeat_returns_come_back_as_they_are() -> None:
    env = make_env()
    leases = [env.acquire(IDENT, scopes=("tool:run",))]
    inputs = env.coordinator._flows.inputs
    for _ in range(3):
        results = env.coordinator.heartbeat_many(leases, ttl=60)
        leases = [result.lease for result in results if result.lease is not None]
        assert len(leases) == 1 and inputs.handle(leases[0]) is leases[0]

    class Liar(str):
        __slots__ = ()

        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    # Scopes that only look plain are rebuilt, never borrowed.
    lying = attrs.evolve(leases[0], scopes=(Liar("tool:run"),))
    checked = inputs.handle(lying)
    assert checked is not lying and type(checked.scopes[0]) is str
    assert env.coordinator.heartbeat(lying, ttl=60).lease is not None
