"""The batched lifecycle operations: many acquires, takeovers or releases in one round trip,
and many holders read in one.

Each item of a batch is the single operation of :mod:`mos_lease.flows`, judged by the same
rules: its inputs are checked as the single call checks them, the policy is asked for it
alone, a denial is audited as the single call audits it, and its write is the guarded write
:func:`mos_lease.machine.plan` makes of its command, with its own new lease UUID and event
id made before anything is sent. Only the store calls are shared: the writes the policy
allowed go to the store together (``WriteMany``: one statement and one commit), and the
reads a batch needs (the holders a takeover tells the policy about, the rows that name a
refusal the store could not) are one ``LoadMany`` each. A refused item is then named and
settled exactly as a single call's refused write is (``_read_decide_write``), and an item
the store did not reach (its row locked elsewhere) is reported as a transient failure.
"""

from __future__ import annotations

from mos_lease.checks import check_batch
from mos_lease.errors import CommitOutcomeUnknown, InvalidInput
from mos_lease.flows import Flows, Lifecycle
from mos_lease.identity import LeaseIdentity, check_epoch, check_id, normalize_ttl
from mos_lease.machine import (
    Acquire,
    PolicyVerdict,
    Release,
    Write,
    audit_entry,
    decide,
    plan,
    success_epoch,
)
from mos_lease.metadata import check_metadata
from mos_lease.policy import PolicyRequest
from mos_lease.records import AuditEntry, Snapshot, WriteOutcome
from mos_lease.results import HolderView, LeaseResult
from mos_lease.store_ops import Flow, LoadMany, WriteMany
from mos_lease.vocabulary import LifecycleEvent

# One item of a batch: its command, the policy's verdict, and the read it was decided on
# (``None``: decided by the write alone, as a single call without a read is).
_Attempt = tuple[Lifecycle, PolicyVerdict, Snapshot | None]


def _distinct(field: str, identities: list[LeaseIdentity]) -> list[LeaseIdentity]:
    # One write per identity and batch: a second would be judged against the first's row
    # within the same statement, which no single call ever is.
    seen: set[LeaseIdentity] = set()
    for identity in identities:
        if identity in seen:
            raise InvalidInput(field, f"{identity} appears twice in one batch")
        seen.add(identity)
    return identities


class BatchFlows(Flows):
    """:class:`~mos_lease.flows.Flows` and the batched operations built on its steps."""

    def acquire_many(self, identities: object, connector_id: object, scopes: object,
                     ttl: object, correlation_id: object,
                     metadata: object = None) -> Flow[list[LeaseResult]]:
        keys = _distinct("identities", [
            self.inputs.identity("identities", identity)
            for identity in check_batch(identities, "identities", LeaseIdentity)])
        connector_id = check_id("connector_id", connector_id)
        norm_scopes = self.inputs.scopes("scopes", scopes)
        norm_ttl = normalize_ttl("ttl", ttl, self.lease_ttl_cap)
        checked_metadata = check_metadata("metadata", metadata)
        correlation = self.correlation(correlation_id)  # one for the batch
        attempts: list[_Attempt] = []
        for identity in keys:
            command = Acquire(identity, connector_id, norm_scopes, norm_ttl, self.ids(),
                              self.ids(), correlation, checked_metadata)
            verdict = self.verdict(PolicyRequest(LifecycleEvent.ACQUIRE, identity,
                                                  connector_id, norm_scopes, norm_ttl))
            attempts.append((command, verdict, None))
        return (yield from self._write_many("acquire_many", attempts))

    def takeover_many(self, targets: object, connector_id: object, scopes: object,
                      ttl: object, correlation_id: object, observed: object = None,
                      metadata: object = None) -> Flow[list[LeaseResult]]:
        pairs = [self._target(target) for target in check_batch(targets, "targets",
                                                                  LeaseIdentity)]
        _distinct("targets", [identity for identity, _ in pairs])
        connector_id = check_id("connector_id", connector_id)
        norm_scopes = self.inputs.scopes("scopes", scopes)
        norm_ttl = normalize_ttl("ttl", ttl, self.lease_ttl_cap)
        checked_metadata = check_metadata("metadata", metadata)
        correlation = self.correlation(correlation_id)
        views = self._observed(observed, pairs)
        # As a single takeover: the policy is told each lease's state and holder, from the
        # view the caller passed or else from a read, here one read for all that need it.
        unread = [k for k, view in enumerate(views) if view is None]
        snapshots: dict[int, Snapshot] = {}
        if unread:
            loaded: list[Snapshot] = list((yield LoadMany(tuple(pairs[k][0] for k in unread))))
            for k, snapshot in zip(unread, loaded, strict=True):
                snapshots[k] = snapshot
                if snapshot.row is not None:
                    views[k] = HolderView.of(snapshot.row, snapshot.now)
        attempts: list[_Attempt] = []
        for k, (identity, epoch) in enumerate(pairs):
            command, verdict = self._takeover(identity, epoch, views[k], connector_id,
                                              norm_scopes, norm_ttl, correlation,
                                              checked_metadata)
            attempts.append((command, verdict, snapshots.get(k)))
        return (yield from self._write_many("takeover_many", attempts))

    def _target(self, target: object) -> tuple[LeaseIdentity, int]:
        if not isinstance(target, tuple) or len(target) != 2:
            raise InvalidInput("targets", "each must be an (identity, expected_epoch) pair")
        return (self.inputs.identity("targets", target[0]),
                check_epoch("expected_epoch", target[1]))

    def _observed(self, observed: object,
                  pairs: list[tuple[LeaseIdentity, int]]) -> list[HolderView | None]:
        """The views the caller passed, one per target (``None`` where it has none), each
        checked as a single takeover checks its ``observed``."""
        if observed is None:
            return [None] * len(pairs)
        if not isinstance(observed, list | tuple) or len(observed) != len(pairs):
            raise InvalidInput("observed", "must be a sequence of HolderView or None, one "
                               "per target")
        return [self.views.check(view, identity, epoch)
                for view, (identity, epoch) in zip(observed, pairs, strict=True)]

    def release_many(self, leases: object, correlation_id: object) -> Flow[list[LeaseResult]]:
        handles = [self.inputs.handle(lease) for lease in check_batch(leases)]
        _distinct("leases", [handle.identity for handle in handles])
        correlation = self.correlation(correlation_id)
        attempts: list[_Attempt] = []
        for handle in handles:
            command = Release(handle.identity, handle.connector_id, handle.lease_id,
                              handle.epoch, self.ids(), correlation)
            verdict = self.verdict(PolicyRequest(LifecycleEvent.RELEASE, handle.identity,
                                                  handle.connector_id, handle.scopes, None))
            attempts.append((command, verdict, None))
        return (yield from self._write_many("release_many", attempts))

    def current_holders(self, identities: object) -> Flow[list[HolderView | None]]:
        # current_holder() for many: a plain read, no policy call and no audit row.
        keys = [self.inputs.identity("identities", identity)
                for identity in check_batch(identities, "identities", LeaseIdentity)]
        if not keys:
            return []
        snapshots: list[Snapshot] = list((yield LoadMany(tuple(keys))))
        return [None if snapshot.row is None
                else self.views.issue(HolderView.of(snapshot.row, snapshot.now), identity)
                for identity, snapshot in zip(keys, snapshots, strict=True)]

    def _write_many(self, method: str, attempts: list[_Attempt]) -> Flow[list[LeaseResult]]:
        """Deny what the policy (or the read it was told of) refuses, send the rest in one
        ``WriteMany``, then settle each item as a single call settles its write."""
        results: dict[int, LeaseResult] = {}
        sent: list[tuple[int, Lifecycle, PolicyVerdict, Write]] = []
        for i, (command, verdict, snapshot) in enumerate(attempts):
            if not verdict.allowed:
                results[i] = yield from self._deny(command, verdict.reason, None)
                continue
            if snapshot is not None:
                # Decided on a read, as a single takeover that read first: a refusal the
                # read already shows is audited and returned without a write.
                reason = decide(snapshot.row, snapshot.now, command, verdict).reason
                if reason is not None:
                    results[i] = yield from self._deny(command, reason, snapshot)
                    continue
            write = plan(command)
            assert write is not None
            sent.append((i, command, verdict, write))
        outcomes = yield from self._send(method, sent)
        # A refusal the store could not name from the row it found (an acquire sees none)
        # is named from a fresh read, one for all of them.
        unnamed = [k for k, outcome in enumerate(outcomes)
                   if outcome.row is None and outcome.reached and outcome.found is None]
        if unnamed:
            loaded: list[Snapshot] = list((yield LoadMany(tuple(
                sent[k][1].identity for k in unnamed))))
            for k, snapshot in zip(unnamed, loaded, strict=True):
                outcomes[k] = WriteOutcome(None, snapshot.now, outcomes[k].reconciled,
                                           found=snapshot)
        for (i, command, verdict, _write), outcome in zip(sent, outcomes, strict=True):
            if outcome.row is not None:
                results[i] = self._success(command, outcome)
            elif not outcome.reached:
                results[i] = self._unsettled(command, "its row is locked by another "
                                                      "transaction")
            else:
                results[i] = yield from self._read_decide_write(command, verdict, outcome.found)
        return [results[i] for i in range(len(attempts))]

    def _send(self, method: str, sent: list[tuple[int, Lifecycle, PolicyVerdict, Write]]
              ) -> Flow[list[WriteOutcome]]:
        """The batch's one store call; if its commit outcome is lost, each write is
        reconciled on its own, by its event id and the lease UUID it carried."""
        if not sent:
            return []
        items: tuple[tuple[Write, AuditEntry], ...] = tuple(
            (write, audit_entry(command, None, success_epoch(command)))
            for _i, command, _verdict, write in sent)
        try:
            return list((yield WriteMany(method, items)))
        except CommitOutcomeUnknown:
            pass
        outcomes: list[WriteOutcome] = []
        for _i, command, _verdict, write in sent:
            outcomes.append((yield from self._reconcile_write(command, write)))
        return outcomes
