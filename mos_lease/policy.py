"""The gateway-owned policy surface, its deny-all default and one concrete policy.

Every policy call receives the normalized requested scopes and TTL (``None`` where no TTL
applies: release), so a policy can enforce least privilege and duration limits. For takeover
it is also told the current row's state, because whether an *active* lease may be preempted
is the policy's call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import attrs

from mos_lease.errors import ConfigurationError, InvalidInput
from mos_lease.identity import (
    GRANT_TTL_CAP,
    LEASE_TTL_CAP,
    LeaseIdentity,
    Scopes,
    check_id,
    normalize_scopes,
    normalize_ttl,
)
from mos_lease.machine import ALLOW, PolicyVerdict
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Reason


@attrs.frozen(slots=True)
class PolicyRequest:
    """One policy question, with every input already normalized."""

    event: LifecycleEvent
    identity: LeaseIdentity
    connector_id: str
    scopes: Scopes
    ttl: timedelta | None
    # Only for takeover: the state of the current row when the request was made, and who
    # holds it (``None`` for both when no row exists).
    current_state: LeaseState | None = None
    current_connector_id: str | None = None


@runtime_checkable
class ConnectorLeaseService(Protocol):
    """Gateway policy: decides every lease and grant operation before the store is written."""

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        """Decide one request: ``PolicyVerdict(True, None)`` allows it; a refusal names its
        ``Reason`` (``policy_denied``, ``scope_not_authorized``, ``ttl_not_authorized``,
        ``preemption_denied``). Called before the store is written; it must not do I/O
        that can hang."""


class DenyAllPolicy:
    """The production default: refuses everything until a real policy is configured."""

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        """Refuse the request with ``policy_denied``."""
        return PolicyVerdict(False, Reason.POLICY_DENIED)


_DENY_POLICY = PolicyVerdict(False, Reason.POLICY_DENIED)
_DENY_SCOPE = PolicyVerdict(False, Reason.SCOPE_NOT_AUTHORIZED)
_DENY_TTL = PolicyVerdict(False, Reason.TTL_NOT_AUTHORIZED)
_DENY_PREEMPT = PolicyVerdict(False, Reason.PREEMPTION_DENIED)


@attrs.frozen(slots=True)
class ConnectorRule:
    """Which connector may hold which bindings, with which scopes and limits.

    Each of ``tenant_id``, ``logical_agent_id``, ``binding_id`` and ``connector_id`` is an
    exact id or ``"*"`` for any.
    """

    tenant_id: str
    logical_agent_id: str
    binding_id: str
    connector_id: str
    scopes: Scopes
    max_lease_ttl: timedelta
    max_grant_ttl: timedelta
    preempt_active: bool = False

    def matches(self, identity: LeaseIdentity, connector_id: str) -> bool:
        """Whether the rule's four id fields (each exact or ``"*"``) match ``identity`` and
        ``connector_id``."""
        return (
            self.tenant_id in ("*", identity.tenant_id)
            and self.logical_agent_id in ("*", identity.logical_agent_id)
            and self.binding_id in ("*", identity.binding_id)
            and self.connector_id in ("*", connector_id)
        )


_RULE_KEYS = frozenset({"tenant_id", "logical_agent_id", "binding_id", "connector_id",
                        "scopes", "max_lease_ttl", "max_grant_ttl", "preempt_active"})


class StaticConnectorPolicy:
    """A configurable policy built from plain data; the first matching rule decides.

    Example document (all ttl values in seconds)::

        {"rules": [{"tenant_id": "acme", "logical_agent_id": "*", "binding_id": "*",
                    "connector_id": "claude-1", "scopes": ["tool:run"],
                    "max_lease_ttl": 60, "max_grant_ttl": 10, "preempt_active": false}]}

    A request no rule matches is denied; so is one asking for scopes or a TTL beyond its
    rule, and a takeover of an active lease unless the rule sets ``preempt_active``. Release
    needs only a matching rule. ``"*"`` matches a whole field; there are no patterns.
    """

    def __init__(self, rules: Sequence[ConnectorRule]) -> None:
        self._rules = tuple(rules)
        # A gateway's policy may name every binding it runs (thousands of exact rules), and
        # every lease and grant operation asks it: the first matching rule is found by an
        # index, not a scan. Exact rules are keyed by their four ids (the first of equal keys
        # kept); rules with a "*" are few and scanned in order. The answer is whichever of
        # the exact rule and the first matching wildcard rule comes first in ``rules``.
        self._exact: dict[tuple[str, str, str, str], int] = {}
        self._wildcard: list[tuple[int, ConnectorRule]] = []
        for index, rule in enumerate(self._rules):
            key = (rule.tenant_id, rule.logical_agent_id, rule.binding_id, rule.connector_id)
            if "*" in key:
                self._wildcard.append((index, rule))
            else:
                self._exact.setdefault(key, index)

    def rule_for(self, identity: LeaseIdentity, connector_id: str) -> ConnectorRule | None:
        """The first rule (in document order) matching ``identity`` and ``connector_id``."""
        first = self._exact.get((identity.tenant_id, identity.logical_agent_id,
                                 identity.binding_id, connector_id))
        for index, rule in self._wildcard:
            if first is not None and index > first:
                break
            if rule.matches(identity, connector_id):
                return rule
        return None if first is None else self._rules[first]

    @property
    def rules(self) -> tuple[ConnectorRule, ...]:
        """The rules, in the order they are tried (read-only: the index is built from them)."""
        return self._rules

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> StaticConnectorPolicy:
        """Build the policy from a document ``{"rules": [...]}`` (parsed JSON, YAML or TOML;
        TTLs in seconds). Every rule is checked here: anything that does not fit raises
        ``ConfigurationError`` naming the rule by its index and the field, and nothing is
        partly loaded. The format, every key and every error: ``docs/policy.md``."""
        if not isinstance(document, Mapping) or set(document) != {"rules"}:
            raise ConfigurationError('policy document must be {"rules": [...]}')
        raw_rules = document["rules"]
        if not isinstance(raw_rules, Sequence) or isinstance(raw_rules, str):
            raise ConfigurationError("rules must be a list")
        return cls([_parse_rule(i, raw) for i, raw in enumerate(raw_rules)])

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        """The first rule matching the identity and connector decides: no match is
        ``policy_denied``; a release is allowed; then scopes beyond the rule
        (``scope_not_authorized``), a TTL beyond its limit (``ttl_not_authorized``) and a
        takeover of an active lease without ``preempt_active`` (``preemption_denied``)
        are refused."""
        rule = self.rule_for(request.identity, request.connector_id)
        if rule is None:
            return _DENY_POLICY
        if request.event is LifecycleEvent.RELEASE:
            # Giving a lease up only ever reduces what a connector can do; a rule narrowed
            # since the lease was taken must not trap the holder into keeping it.
            return ALLOW
        if not set(request.scopes).issubset(rule.scopes):
            return _DENY_SCOPE
        limit = rule.max_grant_ttl if request.event is LifecycleEvent.GRANT_ISSUE else (
            rule.max_lease_ttl)
        if request.ttl is not None and request.ttl > limit:
            return _DENY_TTL
        if (request.event is LifecycleEvent.TAKEOVER
                and request.current_state is LeaseState.ACTIVE and not rule.preempt_active):
            return _DENY_PREEMPT
        return ALLOW


def _parse_rule(index: int, raw: object) -> ConnectorRule:
    where = f"rules[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigurationError(f"{where} must be an object")
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise ConfigurationError(f"{where}: unknown keys {sorted(unknown)}")
    try:
        ids = {key: raw[key] if raw.get(key) == "*" else check_id(f"{where}.{key}", raw[key])
               for key in ("tenant_id", "logical_agent_id", "binding_id", "connector_id")}
        partial = sorted(key for key, value in ids.items() if "*" in value and value != "*")
        if partial:
            raise ConfigurationError(
                f"{where}: {', '.join(partial)}: '*' matches a whole field only; "
                "patterns such as 'claude-*' are not supported")
        preempt = raw.get("preempt_active", False)
        if not isinstance(preempt, bool):
            raise ConfigurationError(f"{where}.preempt_active must be true or false")
        return ConnectorRule(
            **ids,
            scopes=normalize_scopes(f"{where}.scopes", raw["scopes"]),
            max_lease_ttl=normalize_ttl(f"{where}.max_lease_ttl", raw["max_lease_ttl"],
                                        LEASE_TTL_CAP),
            max_grant_ttl=normalize_ttl(f"{where}.max_grant_ttl", raw["max_grant_ttl"],
                                        GRANT_TTL_CAP),
            preempt_active=preempt,
        )
    except KeyError as missing:
        raise ConfigurationError(f"{where}: missing key {missing}") from None
    except InvalidInput as bad:
        raise ConfigurationError(str(bad)) from None


class AllowAllPolicy:
    """Allows everything, preemption included. For tests and demos only: never production."""

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        """Allow the request, whatever it is."""
        return ALLOW
