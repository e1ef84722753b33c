"""Coordinator options: lowered caps are enforced everywhere, caps only tighten, and a
misconfigured policy or id source is a ``ConfigurationError``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    InvalidInput,
    PolicyRequest,
    PolicyVerdict,
)
from mos_lease.clock import ManualClock
from mos_lease.identity import GRANT_TTL_CAP, LEASE_TTL_CAP
from mos_lease_memory import InMemoryLeaseStore
from tests.helpers import IDENT, SCOPES, make_env


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
