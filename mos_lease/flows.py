"""Every coordinator operation, written once as a generator that talks to its store.

An operation such as a takeover is an interleave of decisions and store round trips: read
the row, ask the policy, attempt the guarded write, and on a lost race read again. Written
as plain code it would either call the store (and then exist twice, once calling a
synchronous store and once awaiting an asyncio one) or need callbacks. Written as a
generator it does neither:

* a *flow* decides, and where it needs the store it **yields** a store operation
  (:mod:`mos_lease.store_ops`: ``Load``, ``Apply``, ``RenewMany``, ``Record``,
  ``Committed``);
* the *driver* (the coordinator's ``_run``) performs that operation on its store, sends
  the answer back into the flow, or **throws** the store's error into it, at the point of
  the ``yield`` (where the flow may catch it, as a lost commit is caught and reconciled);
* the flow's ``return`` value is the operation's result.

    def current_holder(self, identity):
        snapshot = yield Load(identity)          # the driver performs store.load(identity)
        return view_of(snapshot.row, snapshot.now)

So the whole protocol is here once, free of I/O: the synchronous and asyncio coordinators
differ only in whether their driver awaits. The rules a flow applies are pure functions of
:mod:`mos_lease.machine`, :mod:`mos_lease.validation` and :mod:`mos_lease.reconciliation`;
a flow only loads, asks them, writes what they decided and mints what they allowed.
(psycopg builds its connections and queries the same way: ``psycopg/generators.py``.)
"""

from __future__ import annotations

import logging
from datetime import timedelta
from uuid import UUID

from mos_lease.checks import check_batch
from mos_lease.errors import (
    CommitOutcomeUnknown,
    InternalInconsistency,
    InvalidInput,
    StoreUnavailable,
)
from mos_lease.grant_flows import GrantFlows
from mos_lease.identity import LeaseIdentity, Scopes, check_epoch, check_id, normalize_ttl
from mos_lease.machine import (
    Acquire,
    Command,
    Heartbeat,
    PolicyVerdict,
    Release,
    Renew,
    Takeover,
    Write,
    audit_entry,
    decide,
    event_of,
    plan,
    preempts,
    presented_epoch,
    success_epoch,
    success_outcome,
)
from mos_lease.metadata import Metadata, check_metadata
from mos_lease.policy import PolicyRequest
from mos_lease.reconciliation import is_own_write, reconciled_row, recorded
from mos_lease.records import AuditEntry, LeaseHandle, Snapshot, WriteOutcome
from mos_lease.results import HolderView, LeaseResult
from mos_lease.store_ops import Apply, Committed, Flow, Load, RenewMany
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason

log = logging.getLogger("mos_lease")

Lifecycle = Acquire | Takeover | Heartbeat | Release


class Flows(GrantFlows):
    """Every operation of one coordinator: the lease operations here, the grant operations
    from :class:`~mos_lease.grant_flows.GrantFlows`, the options from
    :class:`~mos_lease.flow_options.FlowOptions`."""

    # -- lifecycle ---------------------------------------------------------------------------

    def acquire(self, identity: object, connector_id: object, scopes: object, ttl: object,
                correlation_id: object, metadata: object = None) -> Flow[LeaseResult]:
        identity = self.inputs.identity("identity", identity)
        connector_id = check_id("connector_id", connector_id)
        norm_scopes = self.inputs.scopes("scopes", scopes)
        norm_ttl = normalize_ttl("ttl", ttl, self.lease_ttl_cap)
        checked_metadata = check_metadata("metadata", metadata)
        command = Acquire(identity, connector_id, norm_scopes, norm_ttl, self.ids(),
                          self.ids(), self.correlation(correlation_id), checked_metadata)
        verdict = self.verdict(PolicyRequest(LifecycleEvent.ACQUIRE, identity, connector_id,
                                              norm_scopes, norm_ttl))
        return (yield from self._lifecycle(command, verdict, None))

    def takeover(self, identity: object, connector_id: object, scopes: object, ttl: object,
                 expected_epoch: object, correlation_id: object,
                 observed: object = None, metadata: object = None) -> Flow[LeaseResult]:
        identity = self.inputs.identity("identity", identity)
        connector_id = check_id("connector_id", connector_id)
        norm_scopes = self.inputs.scopes("scopes", scopes)
        norm_ttl = normalize_ttl("ttl", ttl, self.lease_ttl_cap)
        epoch = check_epoch("expected_epoch", expected_epoch)
        checked_metadata = check_metadata("metadata", metadata)
        view = self.views.check(observed, identity, epoch)
        correlation = self.correlation(correlation_id)
        # The policy is told the lease's state and holder, so a takeover reads before it
        # writes, unless the caller passes what this coordinator just showed it at this
        # epoch. Either is safe to act on: at one epoch the holder never changes and the
        # state only moves from active to expired or released, and the write's guard
        # re-checks both the epoch and (without preemption) that the lease is not active.
        snapshot: Snapshot | None = None
        if view is None:
            snapshot = yield Load(identity)
            if snapshot.row is not None:
                view = HolderView.of(snapshot.row, snapshot.now)
        command, verdict = self._takeover(identity, epoch, view, connector_id, norm_scopes,
                                          norm_ttl, correlation, checked_metadata)
        return (yield from self._lifecycle(command, verdict, snapshot))

    def _takeover(self, identity: LeaseIdentity, epoch: int, view: HolderView | None,
                  connector_id: str, scopes: Scopes, ttl: timedelta, correlation: str,
                  metadata: Metadata) -> tuple[Takeover, PolicyVerdict]:
        """A takeover at ``epoch`` as the policy judges it, told the lease's state and
        holder as ``view`` shows them (``None``: no row), with its new lease UUID and event
        id made now: for a single takeover and for each of a batch alike."""
        state = None if view is None else view.state
        verdict = self.verdict(PolicyRequest(
            LifecycleEvent.TAKEOVER, identity, connector_id, scopes, ttl,
            current_state=state,
            current_connector_id=None if view is None else view.connector_id))
        command = Takeover(identity, connector_id, scopes, ttl, epoch,
                           preempt_active=preempts(verdict, state), new_lease_id=self.ids(),
                           event_id=self.ids(), correlation_id=correlation, metadata=metadata)
        return command, verdict

    def heartbeat(self, lease: object, ttl: object,
                  correlation_id: object) -> Flow[LeaseResult]:
        handle = self.inputs.handle(lease)
        command, verdict = self._heartbeat(handle, normalize_ttl("ttl", ttl, self.lease_ttl_cap),
                                           self.correlation(correlation_id))
        return (yield from self._lifecycle(command, verdict, None))

    def _heartbeat(self, handle: LeaseHandle, ttl: timedelta,
                   correlation: str) -> tuple[Heartbeat, PolicyVerdict]:
        command = Heartbeat(handle.identity, handle.connector_id, handle.lease_id,
                            handle.epoch, ttl, self.ids(), correlation)
        return command, self.verdict(PolicyRequest(
            LifecycleEvent.HEARTBEAT, handle.identity, handle.connector_id, handle.scopes, ttl))

    def release(self, lease: object, correlation_id: object) -> Flow[LeaseResult]:
        handle = self.inputs.handle(lease)
        command = Release(handle.identity, handle.connector_id, handle.lease_id, handle.epoch,
                          self.ids(), self.correlation(correlation_id))
        verdict = self.verdict(PolicyRequest(LifecycleEvent.RELEASE, handle.identity,
                                              handle.connector_id, handle.scopes, None))
        return (yield from self._lifecycle(command, verdict, None))

    def _lifecycle(self, command: Lifecycle, verdict: PolicyVerdict,
                   snapshot: Snapshot | None) -> Flow[LeaseResult]:
        if not verdict.allowed:
            return (yield from self._deny(command, verdict.reason, None))
        if snapshot is None:
            # Optimistic: the store re-checks the guard, so on the success path the write is
            # the only round trip. A refusal is named from the row the write found, or from
            # a fresh read if the store cannot tell it.
            write = plan(command)
            assert write is not None
            outcome = yield from self._apply(command, write)
            if outcome.row is not None:
                return self._success(command, outcome)
            snapshot = outcome.found  # the row the refused write found, if the store says
        return (yield from self._read_decide_write(command, verdict, snapshot))

    def _read_decide_write(self, command: Lifecycle, verdict: PolicyVerdict,
                           snapshot: Snapshot | None) -> Flow[LeaseResult]:
        """Read, decide, write; on losing a race between read and write, read again."""
        for _ in range(self.max_conflict_retries + 1):
            if snapshot is None:
                snapshot = yield Load(command.identity)
            if is_own_write(command, snapshot.row):
                return self._success(command, WriteOutcome(snapshot.row, snapshot.now,
                                                           reconciled=True))
            decision = decide(snapshot.row, snapshot.now, command, verdict)
            if decision.reason is not None:
                return (yield from self._deny(command, decision.reason, snapshot))
            assert decision.write is not None
            outcome = yield from self._apply(command, decision.write)
            if outcome.row is not None:
                return self._success(command, outcome)
            snapshot = outcome.found
        raise InternalInconsistency(
            f"{event_of(command)} kept conflicting after {self.max_conflict_retries} retries")

    def _apply(self, command: Command, write: Write) -> Flow[WriteOutcome]:
        entry = audit_entry(command, None, success_epoch(command))
        try:
            outcome: WriteOutcome = yield Apply(write, entry)
        except CommitOutcomeUnknown:
            outcome = yield from self._reconcile_write(command, write)
        return outcome

    def _reconcile_write(self, command: Command, write: Write) -> Flow[WriteOutcome]:
        """The write may or may not have committed (:mod:`mos_lease.reconciliation`): ask
        whether its audit row exists rather than retry blindly."""
        try:
            committed: bool = yield Committed(command.event_id)
            snapshot: Snapshot = yield Load(command.identity)
        except StoreUnavailable as down:
            raise CommitOutcomeUnknown(command.event_id, str(down)) from down
        log.warning("mos_lease: %s %s outcome reconciled: committed=%s", event_of(command),
                    command.identity, committed)
        row = reconciled_row(command, write, snapshot.row, snapshot.now) if committed else None
        return WriteOutcome(row, snapshot.now, reconciled=True)

    @staticmethod
    def _success(command: Command, outcome: WriteOutcome) -> LeaseResult:
        assert outcome.row is not None
        return LeaseResult(success_outcome(command), None,
                           command.correlation_id, lease=LeaseHandle.of(outcome.row),
                           current_epoch=outcome.row.epoch, reconciled=outcome.reconciled)

    def _deny(self, command: Command, reason: Reason | None,
              snapshot: Snapshot | None) -> Flow[LeaseResult]:
        """A denial; ``snapshot`` is the read that named a state-based one (``None`` for the
        policy's refusals, which reveal nothing about the lease)."""
        assert reason is not None
        # Sent once more if its reply is lost: the caller gets its refusal (reconciliation).
        yield from recorded(audit_entry(command, reason, presented_epoch(command)))
        log.info("mos_lease: %s denied for %s connector=%s reason=%s", event_of(command),
                 command.identity, command.connector_id, reason)
        if snapshot is None or snapshot.row is None:
            return LeaseResult(Outcome.DENIED, reason, command.correlation_id)
        view = self.views.issue(HolderView.of(snapshot.row, snapshot.now), command.identity)
        return LeaseResult(Outcome.DENIED, reason, command.correlation_id,
                           current_epoch=snapshot.row.epoch, holder=view)

    def heartbeat_many(self, leases: object, ttl: object,
                       correlation_id: object) -> Flow[list[LeaseResult]]:
        handles = [self.inputs.handle(lease) for lease in check_batch(leases)]
        norm_ttl = normalize_ttl("ttl", ttl, self.lease_ttl_cap)
        correlation = self.correlation(correlation_id)  # one for the batch
        attempts = [self._heartbeat(handle, norm_ttl, correlation) for handle in handles]
        results: dict[int, LeaseResult] = {}
        for i, (command, verdict) in enumerate(attempts):
            if not verdict.allowed:
                results[i] = yield from self._deny(command, verdict.reason, None)
        allowed = [i for i in range(len(attempts)) if i not in results]
        # One round trip for every renewal; each is still guarded and audited on its own,
        # and a refused one does not hold back the others.
        writes: list[tuple[Renew, AuditEntry]] = []
        for i in allowed:
            command = attempts[i][0]
            renew = plan(command)
            assert isinstance(renew, Renew)
            writes.append((renew, audit_entry(command, None, success_epoch(command))))
        outcomes: list[WriteOutcome] | None = None
        if writes:
            try:
                outcomes = list((yield RenewMany(tuple(writes))))
            except CommitOutcomeUnknown:
                outcomes = None  # settled one by one below
        for k, i in enumerate(allowed):
            command, verdict = attempts[i]
            if outcomes is not None:
                outcome = outcomes[k]
            else:
                outcome = yield from self._reconcile_write(command, writes[k][0])
            if outcome.row is not None:
                results[i] = self._success(command, outcome)
            elif not outcome.reached:
                results[i] = self._unsettled(command, "its row is locked by another "
                                                      "transaction")
            else:
                try:
                    results[i] = yield from self._read_decide_write(command, verdict, None)
                except StoreUnavailable as down:
                    # This lease alone is held back (a reconciled batch's lease whose row is
                    # locked meets lock_timeout here): the others keep their results.
                    results[i] = self._unsettled(command, str(down))
        return [results[i] for i in range(len(attempts))]

    @staticmethod
    def _unsettled(command: Lifecycle, why: str) -> LeaseResult:
        """A write of a batch (a renewal, or a batched acquire, takeover or release) that
        this call could not settle, while it settled the others: the batch did not reach its
        row (another transaction held it, a fenced transaction of a long tool, and the batch
        went on rather than wait), or its own read or write failed. No refusal was
        established and audited for it: ``store_unavailable``, the reason of a transient
        failure, tried again."""
        log.info("mos_lease: %s of %s not settled in its batch: %s",
                 type(command).__name__.lower(), command.identity, why)
        return LeaseResult(Outcome.DENIED, Reason.STORE_UNAVAILABLE, command.correlation_id)

    def current_holder(self, identity: object) -> Flow[HolderView | None]:
        # A plain read: no policy call and no audit row, since it changes nothing and
        # reveals nothing that could act on the lease (no lease UUID, no scopes).
        identity = self.inputs.identity("identity", identity)
        snapshot: Snapshot = yield Load(identity)
        if snapshot.row is None:
            return None
        return self.views.issue(HolderView.of(snapshot.row, snapshot.now), identity)

    def reconcile(self, identity: object, event_id: object) -> Flow[bool]:
        self.inputs.identity("identity", identity)
        if not isinstance(event_id, UUID):
            raise InvalidInput("event_id", "must be a UUID")
        committed: bool = yield Committed(event_id)
        return committed
