"""Inputs that lie about what they are (str, int, tuple and handle subclasses whose
comparisons, hashes or iteration lie) are reduced to the plain values they hold, or refused,
before any fencing comparison sees them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import UUID

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    Outcome,
    PolicyRequest,
    PolicyVerdict,
    Reason,
)
from mos_lease.checks import check_handle
from mos_lease.identity import LEASE_TTL_CAP, MAX_SCOPES, normalize_scopes, normalize_ttl
from mos_lease.machine import ALLOW
from mos_lease_memory import InMemoryLeaseStore

IDENT = LeaseIdentity("acme", "agent-1", "binding-1")
SCOPES = ("tool:read", "tool:run")


class LyingStr(str):
    """Equal to everything, and hashing like the string it claims to be."""

    __slots__ = ()
    claims = "tool:run"

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return hash(self.claims)


class LyingInt(int):
    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = int.__hash__


class RecordingPolicy:
    def __init__(self) -> None:
        self.requests: list[PolicyRequest] = []

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        self.requests.append(request)
        return ALLOW


def _held() -> tuple[ConnectorLeaseCoordinator, LeaseHandle]:
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    lease = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    return coordinator, lease


def _with(lease: LeaseHandle, field: str, value: object) -> LeaseHandle:
    """``lease`` with one field replaced, bypassing the field's type."""
    changes: dict[str, Any] = {field: value}
    return attrs.evolve(lease, **changes)


# --- scopes ----------------------------------------------------------------------------------


def test_a_lying_str_scope_is_judged_by_the_text_it_holds() -> None:
    """It compares and hashes like "tool:run" but holds text outside the grammar."""
    assert normalize_scopes("scopes", ("tool:run",)) == ("tool:run",)
    liar = LyingStr("NOT A SCOPE")
    for value in [(liar,), [liar]]:
        with pytest.raises(InvalidInput, match="does not match"):
            normalize_scopes("scopes", value)


def test_a_str_subclass_scope_is_reduced_to_the_plain_string_it_holds() -> None:
    """A subclass holding valid text could still lie in the subset checks later."""
    (got,) = normalize_scopes("scopes", [LyingStr("tool:run")])
    assert type(got) is str and got == "tool:run"


def test_a_tuple_subclass_is_iterated_like_any_other_collection() -> None:
    class Sneaky(tuple[str, ...]):
        def __iter__(self) -> Iterator[str]:
            yield "Tool:Run"

    assert normalize_scopes("scopes", ("tool:run",)) == ("tool:run",)
    with pytest.raises(InvalidInput, match="does not match"):
        normalize_scopes("scopes", Sneaky(("tool:run",)))


def test_too_many_scopes_stay_refused() -> None:
    many = [f"s{i}" for i in range(MAX_SCOPES + 1)]
    for _ in range(2):
        with pytest.raises(InvalidInput, match="distinct scopes"):
            normalize_scopes("scopes", many)


# --- TTLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1e-7, 0, -1, math.nan, 300.001], ids=repr)
def test_bad_ttls_are_refused_every_time(value: float) -> None:
    for _ in range(2):
        with pytest.raises(InvalidInput):
            normalize_ttl("ttl", value, LEASE_TTL_CAP)


# --- lease handles ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["identity", "connector_id", "lease_id", "epoch", "scopes"])
def test_a_handle_holding_a_subclass_is_rebuilt_from_plain_values(field: str) -> None:
    _, lease = _held()

    class IdentitySub(LeaseIdentity):
        pass

    class UUIDSub(UUID):
        pass

    value: object = {
        "identity": IdentitySub("acme", "agent-1", "binding-1"),
        "connector_id": LyingStr("conn-a"),
        "lease_id": UUIDSub(int=lease.lease_id.int),
        "epoch": LyingInt(lease.epoch),
        "scopes": list(lease.scopes),
    }[field]
    odd = _with(lease, field, value)
    checked = check_handle(odd)
    assert checked is not odd and checked == lease
    assert type(checked.identity) is LeaseIdentity and type(checked.connector_id) is str
    assert type(checked.lease_id) is UUID and type(checked.epoch) is int
    assert type(checked.scopes) is tuple


def test_a_handle_subclass_is_rebuilt() -> None:
    class HandleSub(LeaseHandle):
        pass

    _, lease = _held()
    odd = HandleSub(lease.identity, lease.connector_id, lease.lease_id, lease.epoch,
                    lease.scopes, lease.expires_at)
    checked = check_handle(odd)
    assert type(checked) is LeaseHandle and checked == lease


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("connector_id", LyingStr("conn-b"), Reason.LEASE_REPLACED),
    ("epoch", LyingInt(7), Reason.EPOCH_MISMATCH),
])
def test_lying_handle_fields_take_no_part_in_fencing(field: str, value: object,
                                                     reason: Reason) -> None:
    """Were the handle used as is, the liar would match the row in every comparison."""
    coordinator, lease = _held()
    odd = _with(lease, field, value)
    for result in (coordinator.heartbeat(odd, ttl=10), coordinator.release(odd)):
        assert result.outcome is Outcome.DENIED and result.reason is reason
    assert coordinator.heartbeat(lease, ttl=10).ok


def test_the_policy_sees_every_call_with_normalized_values() -> None:
    policy = RecordingPolicy()
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), policy)
    lease = coordinator.acquire(IDENT, "conn-a", scopes=["tool:run", "tool:read"],
                                ttl=60).lease
    assert lease is not None
    for _ in range(3):
        assert coordinator.heartbeat(lease, ttl=30).ok
    assert len(policy.requests) == 4
    for request in policy.requests:
        assert request.scopes == SCOPES and type(request.scopes) is tuple
        assert all(type(scope) is str for scope in request.scopes)
        assert type(request.ttl) is timedelta
    assert [r.ttl for r in policy.requests[1:]] == [timedelta(seconds=30)] * 3
