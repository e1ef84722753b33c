"""The flows of grants: minting one after rereading the lease, and validating one.

Written as flows, like the lease operations (:mod:`mos_lease.flows` explains the pattern);
the rules they apply, and their order, are :mod:`mos_lease.validation`'s.
"""

from __future__ import annotations

import logging
from datetime import datetime

import attrs

from mos_lease.context import ConnectorExecutionContext
from mos_lease.errors import CommitOutcomeUnknown, StoreUnavailable
from mos_lease.flow_options import FlowOptions
from mos_lease.grants import ExecutionGrant
from mos_lease.identity import LeaseIdentity, check_correlation_id, normalize_ttl
from mos_lease.machine import IssueGrant, audit_entry, decide, grant_expiry
from mos_lease.policy import PolicyRequest
from mos_lease.reconciliation import recorded
from mos_lease.records import AuditEntry, Snapshot
from mos_lease.results import GrantResult, RenewalResult, ValidationResult
from mos_lease.store_ops import Flow, Load, Record
from mos_lease.validation import (
    Validate,
    context_expiry,
    read_refusal,
    slow_reply,
    validation_audit,
    validation_refusal,
    validation_refusal_unread,
)
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason

log = logging.getLogger("mos_lease")


class GrantFlows(FlowOptions):
    """Grant issue and validation."""

    def issue_grant(self, lease: object, scopes: object, ttl: object,
                    correlation_id: object) -> Flow[GrantResult]:
        handle = self.inputs.handle(lease)
        norm_scopes = self.inputs.scopes("scopes", scopes)
        norm_ttl = normalize_ttl("ttl", ttl, self.grant_ttl_cap)
        command = IssueGrant(handle.identity, handle.connector_id, handle.lease_id,
                             handle.epoch, norm_scopes, norm_ttl, self.ids(),
                             self.correlation(correlation_id))
        verdict = self.verdict(PolicyRequest(LifecycleEvent.GRANT_ISSUE, handle.identity,
                                              handle.connector_id, norm_scopes, norm_ttl))
        row, now = None, datetime.min
        if verdict.allowed:
            # Reread the durable current lease: a grant is never minted from a cached view.
            snapshot: Snapshot = yield Load(handle.identity)
            row, now = snapshot.row, snapshot.now
        decision = decide(row, now, command, verdict)
        # Known committed before a grant is minted; sent once more if its reply is lost.
        yield from recorded(decision.audit)
        if decision.reason is not None:
            log.info("mos_lease: grant denied for %s connector=%s reason=%s", handle.identity,
                     handle.connector_id, decision.reason)
            return GrantResult(Outcome.DENIED, decision.reason, command.correlation_id)
        assert row is not None
        grant = self.grants.mint(
            self.ids(), handle.identity, handle.connector_id, handle.lease_id, handle.epoch,
            norm_scopes, grant_expiry(row, now, norm_ttl), command.correlation_id, now)
        return GrantResult(Outcome.GRANT_ISSUED, None, command.correlation_id, grant)

    def validate(self, grant: object, identity: object, scopes: object,
                 correlation_id: object) -> Flow[ValidationResult]:
        identity = self.inputs.identity("identity", identity)
        requested = self.inputs.scopes("scopes", scopes)
        fallback_correlation = check_correlation_id("correlation_id", correlation_id)
        registry_reason = self.grants.check(grant)
        if registry_reason is Reason.GRANT_UNKNOWN:
            # Nothing in an unrecognized object is trusted, not even for the audit row.
            return (yield from self._deny_validation(
                Reason.GRANT_UNKNOWN, identity, "unrecognized", None,
                fallback_correlation or self.ids().hex))
        assert isinstance(grant, ExecutionGrant)
        command = Validate(identity, requested, grant.identity, grant.connector_id,
                           grant.lease_id, grant.epoch, grant.scopes, grant.expires_at,
                           registry_reason, grant.correlation_id)
        reason = validation_refusal_unread(command)
        if reason is None:
            read, in_flight, reason = yield from self._reread(command, "validation")
            if reason is None:
                assert read is not None and read.row is not None
                return ValidationResult(None, ConnectorExecutionContext(
                    identity=grant.identity, connector_id=grant.connector_id,
                    lease_id=grant.lease_id, epoch=grant.epoch, scopes=requested,
                    expires_at=context_expiry(command, read.row),
                    correlation_id=grant.correlation_id))
            if slow_reply(command, read, reason):
                log.warning("mos_lease: validation reply for %s took %.3f s, past the "
                            "validity it reported", identity, in_flight)
        return (yield from self._deny_validation(reason, identity, grant.connector_id,
                                                 grant.epoch, grant.correlation_id))

    def renew_grant(self, grant: object, identity: object, scopes: object, ttl: object,
                    correlation_id: object) -> Flow[RenewalResult]:
        """A successor of a grant still valid now, with a fresh expiry: for a tool that runs
        longer than one grant. The old grant is judged as :meth:`validate` judges it (same
        reasons, same order, time in flight included), the successor's issue as
        :meth:`issue_grant` (the policy is asked, one ``grant_issue`` audit row either way),
        and the new context's validity against the reply's time in flight again. The
        successor carries the requested scopes, which the old grant's bound: a renewal never
        widens."""
        identity = self.inputs.identity("identity", identity)
        requested = self.inputs.scopes("scopes", scopes)
        norm_ttl = normalize_ttl("ttl", ttl, self.grant_ttl_cap)
        given_correlation = check_correlation_id("correlation_id", correlation_id)
        registry_reason = self.grants.check(grant)
        if registry_reason is Reason.GRANT_UNKNOWN:
            # Nothing in an unrecognized object is trusted, not even for the audit row.
            correlation = given_correlation or self.ids().hex
            entry = validation_audit(self.ids(), Reason.GRANT_UNKNOWN, identity,
                                     "unrecognized", None, correlation)
            yield from _audit_denial(attrs.evolve(entry, event=LifecycleEvent.GRANT_ISSUE),
                                     "renewal")
            return RenewalResult(Reason.GRANT_UNKNOWN, correlation)
        assert isinstance(grant, ExecutionGrant)
        correlation = given_correlation or grant.correlation_id
        old = Validate(identity, requested, grant.identity, grant.connector_id,
                       grant.lease_id, grant.epoch, grant.scopes, grant.expires_at,
                       registry_reason, correlation)
        issue = IssueGrant(grant.identity, grant.connector_id, grant.lease_id, grant.epoch,
                           requested, norm_ttl, self.ids(), correlation)
        reason = validation_refusal_unread(old)
        if reason is None:
            verdict = self.verdict(PolicyRequest(LifecycleEvent.GRANT_ISSUE, grant.identity,
                                                 grant.connector_id, requested, norm_ttl))
            reason = verdict.reason if not verdict.allowed else None
        if reason is not None:
            return (yield from self._deny_renewal(issue, reason, grant.epoch))
        read, in_flight, reason = yield from self._reread(old, "grant renewal")
        if reason is None:
            assert read is not None and read.row is not None
            expires_at = grant_expiry(read.row, read.now, norm_ttl)
            # The successor's context must still be valid once the reply is in hand.
            reason = validation_refusal(
                attrs.evolve(old, granted_scopes=requested, grant_expires_at=expires_at),
                read.row, read.now, in_flight)
        if reason is not None:
            return (yield from self._deny_renewal(issue, reason, grant.epoch))
        assert read is not None and read.row is not None
        yield from recorded(audit_entry(issue, None, grant.epoch))
        successor = self.grants.mint(
            self.ids(), grant.identity, grant.connector_id, grant.lease_id, grant.epoch,
            requested, expires_at, correlation, read.now)
        context = ConnectorExecutionContext(
            identity=grant.identity, connector_id=grant.connector_id,
            lease_id=grant.lease_id, epoch=grant.epoch, scopes=requested,
            expires_at=min(expires_at, read.row.expires_at), correlation_id=correlation)
        return RenewalResult(None, correlation, successor, context)

    def _deny_renewal(self, issue: IssueGrant, reason: Reason,
                      epoch: int) -> Flow[RenewalResult]:
        log.info("mos_lease: grant renewal denied for %s connector=%s reason=%s",
                 issue.identity, issue.connector_id, reason)
        yield from _audit_denial(audit_entry(issue, reason, epoch), "renewal")
        return RenewalResult(reason, issue.correlation_id)

    def _deny_validation(self, reason: Reason, identity: LeaseIdentity, connector_id: str,
                         epoch: int | None, correlation_id: str) -> Flow[ValidationResult]:
        entry = validation_audit(self.ids(), reason, identity, connector_id, epoch,
                                 correlation_id)
        log.info("mos_lease: validation denied for %s connector=%s reason=%s", identity,
                 connector_id, reason)
        yield from _audit_denial(entry, "validation")
        return ValidationResult(reason)

    def _reread(self, command: Validate, what: str
                ) -> Flow[tuple[Snapshot | None, float, Reason | None]]:
        """Reread the lease of ``command``'s grant, after the call began, and judge the grant
        by it (:func:`~mos_lease.validation.read_refusal`): the read (``None`` when the store
        could not be read), the seconds it was in flight, and the refusal, if any."""
        read: Snapshot | None = None
        sent = self.monotonic()
        try:
            read = yield Load(command.granted_identity)
        except StoreUnavailable:
            # Fail closed. The denial's audit append is best effort: the store that could
            # not be read may not take a write either, and then the log line is the record.
            log.warning("mos_lease: %s denied for %s: store unavailable", what,
                        command.identity)
        in_flight = self.monotonic() - sent
        if read is not None:
            self.grants.prune(read.now)
        return read, in_flight, read_refusal(command, read, in_flight)


def _audit_denial(entry: AuditEntry, what: str) -> Flow[None]:
    """Append a refusal's audit row, best effort: the refusal stands whether or not its row
    made it (the log line is the record then)."""
    try:
        yield Record(entry)
    except (StoreUnavailable, CommitOutcomeUnknown):
        log.warning("mos_lease: could not audit denied %s %s", what, entry.event_id)
