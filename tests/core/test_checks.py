"""What the coordinator remembers of checked inputs (mos_lease/checks.py), as an attacker
would probe it: a remembered answer is only ever given for the very object, unchanged."""

from __future__ import annotations

import pytest

from mos_lease import ConnectorLeaseCoordinator, ExecutionGrant
from mos_lease.checks import MAX_REMEMBERED, CheckedInputs
from mos_lease.errors import InvalidInput
from mos_lease.identity import LeaseIdentity
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


def test_a_look_alike_identity_is_never_remembered_and_the_memory_is_bounded() -> None:
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
    assert len(inputs._identities) <= MAX_REMEMBERED
    assert len(inputs._scopes) <= MAX_REMEMBERED
    assert len(inputs._scope_texts) <= MAX_REMEMBERED


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
