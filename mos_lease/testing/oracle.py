"""An independent model of the lease protocol, written straight from the transition table.

The stateful test compares every store against this model. It deliberately shares no logic
with :mod:`mos_lease.machine`: two independent descriptions that must agree step by step.
Times are plain seconds since the start of a run.
"""

from __future__ import annotations

from uuid import UUID

import attrs

from mos_lease.identity import LeaseIdentity
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason


@attrs.define
class ModelLease:
    epoch: int
    lease_id: UUID
    connector_id: str
    scopes: frozenset[str]
    expires: float
    released: bool = False

    def state(self, now: float) -> str:
        if self.released:
            return "released"
        return "expired" if self.expires <= now else "active"


@attrs.frozen
class ModelRule:
    scopes: frozenset[str]
    max_lease_ttl: float
    max_grant_ttl: float
    preempt_active: bool


@attrs.frozen
class Expected:
    """What one step must produce: its outcome, reason and audit row (if any)."""

    outcome: Outcome
    reason: Reason | None
    event: LifecycleEvent
    audit_epoch: int | None
    audited: bool = True


class Oracle:
    """The stateful specification's independent model of the protocol: given the policy's
    rules and a model clock, it predicts the outcome, reason and audit row of every step,
    so that :func:`make_lease_machine` can compare a store's answers with it."""

    def __init__(self, rules: dict[str, ModelRule]) -> None:
        self.rules = rules
        self.now = 0.0
        self.leases: dict[LeaseIdentity, ModelLease] = {}

    def _policy(self, connector_id: str, scopes: frozenset[str], ttl: float | None,
                grant: bool, current: ModelLease | None = None,
                takeover: bool = False) -> Reason | None:
        rule = self.rules.get(connector_id)
        if rule is None:
            return Reason.POLICY_DENIED
        if not scopes <= rule.scopes:
            return Reason.SCOPE_NOT_AUTHORIZED
        limit = rule.max_grant_ttl if grant else rule.max_lease_ttl
        if ttl is not None and ttl > limit:
            return Reason.TTL_NOT_AUTHORIZED
        if (takeover and current is not None and current.state(self.now) == "active"
                and not rule.preempt_active):
            return Reason.PREEMPTION_DENIED
        return None

    def _holder(self, lease: ModelLease | None, connector_id: str, lease_id: UUID,
                epoch: int) -> Reason | None:
        if lease is None:
            return Reason.LEASE_MISSING
        if epoch < lease.epoch:
            return Reason.STALE_EPOCH
        if epoch > lease.epoch:
            return Reason.EPOCH_MISMATCH
        if lease_id != lease.lease_id or connector_id != lease.connector_id:
            return Reason.LEASE_REPLACED
        if lease.released:
            return Reason.LEASE_RELEASED
        if lease.expires <= self.now:
            return Reason.LEASE_EXPIRED
        return None

    def acquire(self, identity: LeaseIdentity, connector_id: str, scopes: frozenset[str],
                ttl: float) -> Expected:
        """The expected result of an acquire."""
        event = LifecycleEvent.ACQUIRE
        reason = self._policy(connector_id, scopes, ttl, grant=False)
        lease = self.leases.get(identity)
        if reason is None and lease is not None:
            reason = (Reason.LEASE_HELD if lease.state(self.now) == "active"
                      else Reason.TAKEOVER_REQUIRED)
        if reason is not None:
            return Expected(Outcome.DENIED, reason, event, None)
        return Expected(Outcome.ACQUIRED, None, event, 1)

    def takeover(self, identity: LeaseIdentity, connector_id: str, scopes: frozenset[str],
                 ttl: float, expected_epoch: int) -> Expected:
        """The expected result of a takeover at ``expected_epoch``."""
        event = LifecycleEvent.TAKEOVER
        lease = self.leases.get(identity)
        reason = self._policy(connector_id, scopes, ttl, grant=False, current=lease,
                              takeover=True)
        if reason is None:
            if lease is None:
                reason = Reason.LEASE_MISSING
            elif lease.epoch != expected_epoch:
                reason = Reason.EPOCH_MISMATCH
        if reason is not None:
            return Expected(Outcome.DENIED, reason, event, expected_epoch)
        return Expected(Outcome.TAKEN_OVER, None, event, expected_epoch + 1)

    def heartbeat(self, identity: LeaseIdentity, connector_id: str, lease_id: UUID,
                  epoch: int, scopes: frozenset[str], ttl: float) -> Expected:
        """The expected result of a heartbeat of the lease with these fields."""
        event = LifecycleEvent.HEARTBEAT
        reason = self._policy(connector_id, scopes, ttl, grant=False) or self._holder(
            self.leases.get(identity), connector_id, lease_id, epoch)
        if reason is not None:
            return Expected(Outcome.DENIED, reason, event, epoch)
        return Expected(Outcome.RENEWED, None, event, epoch)

    def release(self, identity: LeaseIdentity, connector_id: str, lease_id: UUID, epoch: int,
                scopes: frozenset[str]) -> Expected:
        """The expected result of a release of the lease with these fields."""
        event = LifecycleEvent.RELEASE
        reason = self._policy(connector_id, scopes, None, grant=False) or self._holder(
            self.leases.get(identity), connector_id, lease_id, epoch)
        if reason is not None:
            return Expected(Outcome.DENIED, reason, event, epoch)
        return Expected(Outcome.RELEASED, None, event, epoch)

    def issue_grant(self, identity: LeaseIdentity, connector_id: str, lease_id: UUID,
                    epoch: int, scopes: frozenset[str], ttl: float) -> Expected:
        """The expected result of issuing a grant for the lease with these fields."""
        event = LifecycleEvent.GRANT_ISSUE
        lease = self.leases.get(identity)
        reason = self._policy(connector_id, scopes, ttl, grant=True) or self._holder(
            lease, connector_id, lease_id, epoch)
        if reason is None and lease is not None and not scopes <= lease.scopes:
            reason = Reason.SCOPE_NOT_AUTHORIZED
        if reason is not None:
            return Expected(Outcome.DENIED, reason, event, epoch)
        return Expected(Outcome.GRANT_ISSUED, None, event, epoch)

    def validate(self, *, recognized: bool, granted: LeaseIdentity, target: LeaseIdentity,
                 connector_id: str, lease_id: UUID, epoch: int, grant_scopes: frozenset[str],
                 grant_expires: float, requested: frozenset[str]) -> Expected:
        """The expected result of validating a grant (``recognized``: minted by this
        coordinator instance) for ``target`` and ``requested`` scopes."""
        event = LifecycleEvent.GRANT_VALIDATE
        if not recognized:
            return Expected(Outcome.DENIED, Reason.GRANT_UNKNOWN, event, None)
        reason: Reason | None = None
        if granted.tenant_id != target.tenant_id:
            reason = Reason.TENANT_MISMATCH
        elif granted.logical_agent_id != target.logical_agent_id:
            reason = Reason.AGENT_MISMATCH
        elif granted.binding_id != target.binding_id:
            reason = Reason.BINDING_MISMATCH
        elif grant_expires <= self.now:
            reason = Reason.GRANT_EXPIRED
        else:
            lease = self.leases.get(granted)
            reason = self._holder(lease, connector_id, lease_id, epoch)
            if reason is None and lease is not None and not (
                    requested <= grant_scopes and requested <= lease.scopes):
                reason = Reason.SCOPE_NOT_AUTHORIZED
        if reason is not None:
            return Expected(Outcome.DENIED, reason, event, epoch)
        return Expected(Outcome.VALIDATED, None, event, epoch, audited=False)
