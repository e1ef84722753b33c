"""The gateway policy surface: deny-all default, the static rule policy, and what every policy
call is told."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mos_lease import (
    AllowAllPolicy,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    ConnectorLeaseService,
    DenyAllPolicy,
    GrantResult,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    LeaseResult,
    PolicyRequest,
    PolicyVerdict,
    Reason,
    StaticConnectorPolicy,
)
from mos_lease.policy import ConnectorRule
from mos_lease.vocabulary import LeaseState, LifecycleEvent
from tests.helpers import IDENT, OTHER_IDENT, CountingIds, expire, make_env

ALL_EVENTS = [LifecycleEvent.ACQUIRE, LifecycleEvent.TAKEOVER, LifecycleEvent.HEARTBEAT,
              LifecycleEvent.RELEASE, LifecycleEvent.GRANT_ISSUE]


def _request(event: LifecycleEvent = LifecycleEvent.ACQUIRE, *,
             identity: LeaseIdentity = IDENT, connector_id: str = "claude-1",
             scopes: tuple[str, ...] = ("tool:run",), ttl: float | None = 30,
             state: LeaseState | None = None, holder: str | None = None) -> PolicyRequest:
    return PolicyRequest(event, identity, connector_id, scopes,
                         None if ttl is None else timedelta(seconds=ttl),
                         current_state=state, current_connector_id=holder)


def _rule(**overrides: Any) -> dict[str, Any]:
    rule: dict[str, Any] = {"tenant_id": "acme", "logical_agent_id": "*", "binding_id": "*",
                            "connector_id": "claude-1", "scopes": ["tool:run", "tool:read"],
                            "max_lease_ttl": 60, "max_grant_ttl": 10}
    rule.update(overrides)
    return rule


# --- deny-all --------------------------------------------------------------------------------


@pytest.mark.parametrize("event", ALL_EVENTS)
@pytest.mark.parametrize("state", [None, *LeaseState])
def test_deny_all_denies_everything(event: LifecycleEvent, state: LeaseState | None) -> None:
    verdict = DenyAllPolicy().authorize(_request(event, state=state, scopes=(), ttl=None))
    assert verdict == PolicyVerdict(False, Reason.POLICY_DENIED)
    assert not verdict.allowed


def test_the_production_default_is_deny_all() -> None:
    env = make_env()
    lease = env.acquire()
    default = ConnectorLeaseCoordinator(env.store, id_source=CountingIds())
    assert isinstance(default._flows.policy, DenyAllPolicy)
    c = default
    results: list[LeaseResult | GrantResult] = [
        c.acquire(OTHER_IDENT, "claude-1", scopes=[], ttl=10),
        c.takeover(IDENT, "claude-1", scopes=[], ttl=10, expected_epoch=1),
        c.heartbeat(lease, ttl=10),
        c.issue_grant(lease, scopes=[], ttl=5),
        c.release(lease),
    ]
    assert [r.reason for r in results] == [Reason.POLICY_DENIED] * 5
    expire(env, lease)
    assert c.takeover(IDENT, "claude-1", scopes=[], ttl=10,
                      expected_epoch=1).reason is Reason.POLICY_DENIED
    assert [r.epoch for r in env.rows()] == [1]


def test_shipped_policies_fit_the_service_protocol() -> None:
    for policy in (DenyAllPolicy(), AllowAllPolicy(), StaticConnectorPolicy([])):
        assert isinstance(policy, ConnectorLeaseService)


def test_a_verdict_has_a_reason_exactly_when_it_denies() -> None:
    with pytest.raises(ValueError):
        PolicyVerdict(True, Reason.POLICY_DENIED)
    with pytest.raises(ValueError):
        PolicyVerdict(False)


# --- StaticConnectorPolicy -------------------------------------------------------------------


def test_from_dict_builds_normalized_rules() -> None:
    policy = StaticConnectorPolicy.from_dict({"rules": [_rule(
        scopes=["tool:run", "tool:read", "tool:run"], preempt_active=True)]})
    assert policy.rules == (ConnectorRule(
        tenant_id="acme", logical_agent_id="*", binding_id="*", connector_id="claude-1",
        scopes=("tool:read", "tool:run"), max_lease_ttl=timedelta(seconds=60),
        max_grant_ttl=timedelta(seconds=10), preempt_active=True),)


def test_empty_rule_list_denies_everything() -> None:
    policy = StaticConnectorPolicy.from_dict({"rules": []})
    for event in ALL_EVENTS:
        assert policy.authorize(_request(event)).reason is Reason.POLICY_DENIED


@pytest.mark.parametrize(("identity", "connector", "allowed"), [
    (IDENT, "claude-1", True),
    (LeaseIdentity("acme", "any-agent", "any-binding"), "claude-1", True),
    (LeaseIdentity("other", "agent-1", "binding-1"), "claude-1", False),
    (IDENT, "claude-2", False),
])
def test_wildcards_match_any_value_and_exact_ids_match_exactly(
        identity: LeaseIdentity, connector: str, allowed: bool) -> None:
    policy = StaticConnectorPolicy.from_dict({"rules": [_rule()]})
    verdict = policy.authorize(_request(identity=identity, connector_id=connector))
    assert verdict.allowed is allowed
    if not allowed:
        assert verdict.reason is Reason.POLICY_DENIED


def test_a_literal_star_is_a_wildcard_in_every_id_field() -> None:
    policy = StaticConnectorPolicy.from_dict({"rules": [_rule(
        tenant_id="*", logical_agent_id="*", binding_id="*", connector_id="*")]})
    anyone = LeaseIdentity("t", "a", "b")
    assert policy.authorize(_request(identity=anyone, connector_id="whoever")).allowed


def test_the_first_matching_rule_decides() -> None:
    narrow_first = StaticConnectorPolicy.from_dict({"rules": [
        _rule(scopes=["tool:read"]), _rule(scopes=["tool:run", "tool:read"])]})
    assert narrow_first.authorize(_request(scopes=("tool:run",))).reason is (
        Reason.SCOPE_NOT_AUTHORIZED)
    wide_first = StaticConnectorPolicy.from_dict({"rules": [
        _rule(scopes=["tool:run"]), _rule(scopes=["tool:read"])]})
    assert wide_first.authorize(_request(scopes=("tool:run",))).allowed
    # A rule that does not match is skipped.
    skip = StaticConnectorPolicy.from_dict({"rules": [
        _rule(connector_id="other", scopes=[]), _rule(scopes=["tool:run"])]})
    assert skip.authorize(_request(scopes=("tool:run",))).allowed


_IDS = st.sampled_from(["a", "b", "*"])


@settings(max_examples=300, deadline=None)
@given(rules=st.lists(st.tuples(_IDS, _IDS, _IDS, _IDS, st.integers(0, 3)), max_size=12),
       asked=st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["a", "b"]),
                       st.sampled_from(["a", "b"]), st.sampled_from(["a", "b"])))
def test_the_indexed_rule_is_the_first_match_in_document_order(
        rules: list[tuple[str, str, str, str, int]], asked: tuple[str, str, str, str]) -> None:
    """The policy finds its rule through an index of exact rules and a scan of the wildcard
    ones; whatever the mix and order, it is the rule a scan in document order finds first
    (rules of equal ids told apart by their ttl)."""
    policy = StaticConnectorPolicy.from_dict({"rules": [
        _rule(tenant_id=t, logical_agent_id=a, binding_id=b, connector_id=c,
              max_lease_ttl=10 + n) for t, a, b, c, n in rules]})
    identity, connector = LeaseIdentity(*asked[:3]), asked[3]
    scanned = next((index for index, rule in enumerate(policy.rules)
                    if rule.matches(identity, connector)), None)
    found = policy.rule_for(identity, connector)
    assert found is (None if scanned is None else policy.rules[scanned])


def test_thousands_of_exact_rules_are_found_without_a_scan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway's policy that names each of its 5,000 bindings answers through its index:
    no rule's ``matches`` is called for an exact rule, and the answer is still the first."""
    policy = StaticConnectorPolicy.from_dict({"rules": [
        _rule(logical_agent_id=f"agent-{n}", binding_id="main", max_lease_ttl=60)
        for n in range(5000)] + [_rule(logical_agent_id="agent-7", binding_id="main",
                                       max_lease_ttl=5)]})
    calls: list[ConnectorRule] = []
    real = ConnectorRule.matches

    def counted(rule: ConnectorRule, identity: LeaseIdentity, connector_id: str) -> bool:
        calls.append(rule)
        return real(rule, identity, connector_id)

    monkeypatch.setattr(ConnectorRule, "matches", counted)
    wanted = LeaseIdentity("acme", "agent-4999", "main")
    assert policy.authorize(_request(identity=wanted)).allowed
    assert policy.authorize(_request(identity=LeaseIdentity("acme", "agent-7", "main"),
                                     ttl=30)).allowed  # the first of equal rules: 60 s
    assert not policy.authorize(_request(identity=LeaseIdentity("acme", "x", "main"))).allowed
    assert calls == []


@pytest.mark.parametrize(("scopes", "allowed"), [
    ((), True), (("tool:run",), True), (("tool:read", "tool:run"), True),
    (("tool:admin",), False), (("tool:read", "tool:write"), False),
])
def test_requested_scopes_must_be_a_subset(scopes: tuple[str, ...], allowed: bool) -> None:
    policy = StaticConnectorPolicy.from_dict({"rules": [_rule()]})
    verdict = policy.authorize(_request(scopes=scopes))
    assert verdict.allowed is allowed
    assert verdict.reason is (None if allowed else Reason.SCOPE_NOT_AUTHORIZED)


@pytest.mark.parametrize(("event", "ttl", "allowed"), [
    (LifecycleEvent.ACQUIRE, 60, True),
    (LifecycleEvent.ACQUIRE, 60.001, False),
    (LifecycleEvent.TAKEOVER, 61, False),
    (LifecycleEvent.HEARTBEAT, 60, True),
    (LifecycleEvent.HEARTBEAT, 61, False),
    (LifecycleEvent.GRANT_ISSUE, 10, True),
    (LifecycleEvent.GRANT_ISSUE, 11, False),  # grants have their own, tighter limit
    (LifecycleEvent.RELEASE, None, True),
])
def test_lease_and_grant_ttl_limits(event: LifecycleEvent, ttl: float | None,
                                    allowed: bool) -> None:
    policy = StaticConnectorPolicy.from_dict({"rules": [_rule()]})
    verdict = policy.authorize(_request(event, ttl=ttl))
    assert verdict.allowed is allowed
    assert verdict.reason is (None if allowed else Reason.TTL_NOT_AUTHORIZED)


@pytest.mark.parametrize(("state", "preempt", "allowed"), [
    (LeaseState.ACTIVE, False, False),
    (LeaseState.ACTIVE, True, True),
    (LeaseState.EXPIRED, False, True),
    (LeaseState.RELEASED, False, True),
    (None, False, True),
])
def test_preempting_an_active_lease_needs_preempt_active(
        state: LeaseState | None, preempt: bool, allowed: bool) -> None:
    policy = StaticConnectorPolicy.from_dict({"rules": [_rule(preempt_active=preempt)]})
    verdict = policy.authorize(_request(LifecycleEvent.TAKEOVER, state=state, holder="x"))
    assert verdict.allowed is allowed
    assert verdict.reason is (None if allowed else Reason.PREEMPTION_DENIED)
    # preempt_active only ever matters for takeover.
    assert policy.authorize(_request(LifecycleEvent.ACQUIRE, state=state)).allowed


def test_static_policy_through_the_coordinator() -> None:
    env = make_env(StaticConnectorPolicy.from_dict({"rules": [
        _rule(connector_id="claude-1"), _rule(connector_id="claude-2", preempt_active=True)]}))
    c = env.coordinator
    first = c.acquire(IDENT, "claude-1", scopes=["tool:run"], ttl=60)
    assert first.ok and first.lease is not None
    assert c.acquire(OTHER_IDENT, "codex-1", scopes=[], ttl=60).reason is Reason.POLICY_DENIED
    assert c.takeover(IDENT, "claude-1", scopes=["tool:run"], ttl=60,
                      expected_epoch=1).reason is Reason.PREEMPTION_DENIED
    preempted = c.takeover(IDENT, "claude-2", scopes=["tool:run"], ttl=60, expected_epoch=1)
    assert preempted.ok and preempted.lease is not None and preempted.lease.epoch == 2
    assert c.issue_grant(preempted.lease, scopes=["tool:run"], ttl=11).reason is (
        Reason.TTL_NOT_AUTHORIZED)
    assert c.issue_grant(preempted.lease, scopes=["tool:admin"], ttl=5).reason is (
        Reason.SCOPE_NOT_AUTHORIZED)
    assert c.issue_grant(preempted.lease, scopes=["tool:run"], ttl=10).ok


# --- malformed documents -----------------------------------------------------------------------


def _without(key: str) -> dict[str, Any]:
    rule = _rule()
    del rule[key]
    return rule


MALFORMED: dict[str, object] = {
    "not-a-mapping": [_rule()],
    "none": None,
    "empty": {},
    "extra-top-level-key": {"rules": [], "version": 1},
    "rules-a-string": {"rules": "tenant_id=acme"},
    "rules-a-mapping": {"rules": {"0": _rule()}},
    "rules-none": {"rules": None},
    "rule-not-an-object": {"rules": [5]},
    "rule-a-list": {"rules": [list(_rule().items())]},
    "unknown-key": {"rules": [_rule(max_ttl=30)]},
    "misspelt-key": {"rules": [_rule(preempt=True)]},
    **{f"missing-{k}": {"rules": [_without(k)]} for k in (
        "tenant_id", "logical_agent_id", "binding_id", "connector_id", "scopes",
        "max_lease_ttl", "max_grant_ttl")},
    "empty-tenant": {"rules": [_rule(tenant_id="")]},
    "padded-agent": {"rules": [_rule(logical_agent_id=" agent")]},
    "control-in-binding": {"rules": [_rule(binding_id="b\x00")]},
    "int-connector": {"rules": [_rule(connector_id=7)]},
    "none-connector": {"rules": [_rule(connector_id=None)]},
    "list-tenant": {"rules": [_rule(tenant_id=["acme"])]},
    "scopes-string": {"rules": [_rule(scopes="tool:run")]},
    "scopes-bad-grammar": {"rules": [_rule(scopes=["Tool:Run"])]},
    "scopes-non-str": {"rules": [_rule(scopes=[1])]},
    "lease-ttl-over-cap": {"rules": [_rule(max_lease_ttl=301)]},
    "grant-ttl-over-cap": {"rules": [_rule(max_grant_ttl=31)]},
    "lease-ttl-zero": {"rules": [_rule(max_lease_ttl=0)]},
    "grant-ttl-negative": {"rules": [_rule(max_grant_ttl=-1)]},
    "ttl-bool": {"rules": [_rule(max_lease_ttl=True)]},
    "ttl-string": {"rules": [_rule(max_grant_ttl="10")]},
    "ttl-nan": {"rules": [_rule(max_lease_ttl=float("nan"))]},
    "ttl-none": {"rules": [_rule(max_lease_ttl=None)]},
    "preempt-string": {"rules": [_rule(preempt_active="true")]},
    "preempt-int": {"rules": [_rule(preempt_active=1)]},
    "preempt-none": {"rules": [_rule(preempt_active=None)]},
    "second-rule-bad": {"rules": [_rule(), _rule(max_grant_ttl=60)]},
}


@pytest.mark.parametrize("document", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_documents_are_configuration_errors(document: Any) -> None:
    with pytest.raises(ConfigurationError) as caught:
        StaticConnectorPolicy.from_dict(document)
    assert not isinstance(caught.value, InvalidInput)


def test_configuration_errors_say_which_rule() -> None:
    with pytest.raises(ConfigurationError, match=r"rules\[1\]"):
        StaticConnectorPolicy.from_dict({"rules": [_rule(), _rule(max_grant_ttl=60)]})
    with pytest.raises(ConfigurationError, match="unknown keys"):
        StaticConnectorPolicy.from_dict({"rules": [_rule(colour="red")]})


def test_from_dict_does_not_alias_the_document() -> None:
    document = {"rules": [_rule()]}
    snapshot = copy.deepcopy(document)
    policy = StaticConnectorPolicy.from_dict(document)
    document["rules"][0]["scopes"].append("tool:admin")
    assert document != snapshot
    assert policy.authorize(_request(scopes=("tool:admin",))).reason is (
        Reason.SCOPE_NOT_AUTHORIZED)


# --- what every policy call receives --------------------------------------------------------


@attrs.define
class RecordingPolicy:
    """Allows everything and remembers every request."""

    requests: list[PolicyRequest] = attrs.Factory(list)

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        self.requests.append(request)
        return PolicyVerdict(True)

    def last(self) -> PolicyRequest:
        return self.requests[-1]


def test_every_call_receives_normalized_scopes_and_ttl() -> None:
    policy = RecordingPolicy()
    env = make_env(policy)
    c = env.coordinator
    acquired = c.acquire(IDENT, "claude-1", scopes=["tool:run", "tool:read", "tool:run"],
                         ttl=30)
    assert acquired.lease is not None
    assert policy.last() == PolicyRequest(LifecycleEvent.ACQUIRE, IDENT, "claude-1",
                                          ("tool:read", "tool:run"), timedelta(seconds=30))
    c.heartbeat(acquired.lease, ttl=12.5)
    assert policy.last() == PolicyRequest(LifecycleEvent.HEARTBEAT, IDENT, "claude-1",
                                          ("tool:read", "tool:run"),
                                          timedelta(seconds=12.5))
    c.issue_grant(acquired.lease, scopes={"tool:run", "tool:read"}, ttl=timedelta(seconds=3))
    assert policy.last() == PolicyRequest(LifecycleEvent.GRANT_ISSUE, IDENT, "claude-1",
                                          ("tool:read", "tool:run"), timedelta(seconds=3))
    c.release(acquired.lease)
    assert policy.last() == PolicyRequest(LifecycleEvent.RELEASE, IDENT, "claude-1",
                                          ("tool:read", "tool:run"), None)
    for request in policy.requests:
        assert request.scopes == tuple(sorted(set(request.scopes)))
        assert request.ttl is None or type(request.ttl) is timedelta
    assert len(policy.requests) == 4


def test_takeover_is_told_the_current_row_state_and_holder() -> None:
    policy = RecordingPolicy()
    env = make_env(policy)
    c = env.coordinator

    def takeover(expected: int, who: str) -> PolicyRequest:
        c.takeover(IDENT, who, scopes=["tool:run", "tool:run"], ttl=20, expected_epoch=expected)
        request = policy.last()
        assert request.event is LifecycleEvent.TAKEOVER
        assert request.scopes == ("tool:run",) and request.ttl == timedelta(seconds=20)
        return request

    missing = takeover(1, "claude-2")
    assert (missing.current_state, missing.current_connector_id) == (None, None)
    lease = env.acquire(connector_id="claude-1", ttl=10)
    active = takeover(1, "claude-2")
    assert (active.current_state, active.current_connector_id) == (
        LeaseState.ACTIVE, "claude-1")
    env.clock.advance(20)
    expired = takeover(2, "claude-3")
    assert (expired.current_state, expired.current_connector_id) == (
        LeaseState.EXPIRED, "claude-2")
    holder = c.acquire(OTHER_IDENT, "x", scopes=[], ttl=10)  # unrelated identity
    assert holder.ok
    current = env.rows()[0]
    assert current.connector_id == "claude-3"
    assert c.release(LeaseHandle.of(current)).ok
    released = takeover(3, "claude-4")
    assert (released.current_state, released.current_connector_id) == (
        LeaseState.RELEASED, "claude-3")
    assert lease.epoch == 1


def test_a_hand_built_handle_still_gives_the_policy_normalized_scopes() -> None:
    """Heartbeat and release pass the handle's scopes to the policy without normalizing
    them: a handle built or edited by the caller reaches the policy as given."""
    policy = RecordingPolicy()
    env = make_env(policy)
    lease = env.acquire(scopes=["tool:read", "tool:run"])
    messy = attrs.evolve(lease, scopes=("tool:run", "tool:read", "tool:run"))
    env.coordinator.heartbeat(messy, ttl=10)
    env.coordinator.release(messy)
    seen = [r.scopes for r in policy.requests[-2:]]
    assert seen == [("tool:read", "tool:run")] * 2


def test_release_needs_only_a_matching_rule_even_after_the_rule_was_narrowed() -> None:
    from mos_lease.identity import LeaseIdentity

    narrowed = StaticConnectorPolicy.from_dict({"rules": [
        {"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*", "connector_id": "c1",
         "scopes": ["a"], "max_lease_ttl": 10, "max_grant_ttl": 5}]})
    identity = LeaseIdentity("t", "a", "b")
    release = PolicyRequest(LifecycleEvent.RELEASE, identity, "c1", ("a", "z"), None)
    assert narrowed.authorize(release).allowed
    heartbeat = PolicyRequest(LifecycleEvent.HEARTBEAT, identity, "c1", ("a", "z"),
                              timedelta(seconds=5))
    assert narrowed.authorize(heartbeat).reason is Reason.SCOPE_NOT_AUTHORIZED
    stranger = PolicyRequest(LifecycleEvent.RELEASE, identity, "c2", ("a",), None)
    assert narrowed.authorize(stranger).reason is Reason.POLICY_DENIED


def test_partial_wildcards_are_refused_not_taken_literally() -> None:
    with pytest.raises(ConfigurationError, match="whole field"):
        StaticConnectorPolicy.from_dict({"rules": [
            {"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*",
             "connector_id": "claude-*", "scopes": [], "max_lease_ttl": 10,
             "max_grant_ttl": 5}]})
