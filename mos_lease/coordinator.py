"""The coordinator: the thin imperative shell around the pure core.

Every operation is written once, as a generator ("flow") that yields store operations and
receives their results. Two drivers run the same flows: ``ConnectorLeaseCoordinator`` calls a
synchronous store, ``AsyncConnectorLeaseCoordinator`` awaits an asyncio one. Neither driver
knows anything about leases, so the two cannot drift apart.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Sequence
from datetime import datetime, timedelta
from typing import Any, Final, Generic, TypeVar
from uuid import UUID

import attrs

from mos_lease.clock import MonotonicClock, default_clock
from mos_lease.context import ConnectorExecutionContext
from mos_lease.errors import (
    CommitOutcomeUnknown,
    ConfigurationError,
    InternalInconsistency,
    InvalidInput,
    StoreUnavailable,
)
from mos_lease.events import (
    Emitter,
    EventHook,
    OperationFinished,
    StoreCall,
    emitter,
    store_system,
)
from mos_lease.flowdrive import Drive, Failed, outcome_of, outcome_of_async
from mos_lease.grants import ExecutionGrant, GrantRegistry
from mos_lease.identity import (
    GRANT_TTL_CAP,
    LEASE_TTL_CAP,
    LeaseIdentity,
    check_correlation_id,
    check_epoch,
    check_id,
    check_identity,
    normalize_scopes,
    normalize_ttl,
)
from mos_lease.machine import (
    Acquire,
    Close,
    Command,
    Heartbeat,
    Insert,
    IssueGrant,
    PolicyVerdict,
    Release,
    Renew,
    Rotate,
    Takeover,
    Validate,
    Write,
    audit_entry,
    context_expiry,
    decide,
    event_of,
    grant_expiry,
    plan,
    preempts,
    presented_epoch,
    success_epoch,
    success_outcome,
    validation_audit,
    validation_refusal,
    validation_refusal_unread,
)
from mos_lease.operation import SHARED_START
from mos_lease.policy import ConnectorLeaseService, DenyAllPolicy, PolicyRequest
from mos_lease.ports import AsyncLeaseStore, IdSource, LeaseStore
from mos_lease.records import AuditEntry, LeaseHandle, LeaseRow, Snapshot, WriteOutcome
from mos_lease.results import (
    GrantResult,
    HolderView,
    InvocationResult,
    LeaseResult,
    ValidationResult,
)
from mos_lease.views import ViewRegistry
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason

log = logging.getLogger("mos_lease")

T = TypeVar("T")
S = TypeVar("S")

# --- store operations a flow can yield ---------------------------------------------------


@attrs.frozen(slots=True)
class Load:
    identity: LeaseIdentity


@attrs.frozen(slots=True)
class Apply:
    write: Write
    entry: AuditEntry


@attrs.frozen(slots=True)
class RenewMany:
    items: tuple[tuple[Renew, AuditEntry], ...]


@attrs.frozen(slots=True)
class Record:
    entry: AuditEntry


@attrs.frozen(slots=True)
class Committed:
    event_id: UUID


Op = Load | Apply | RenewMany | Record | Committed
Flow = Generator[Op, Any, T]

DEFAULT_MAX_CONFLICT_RETRIES = 8
MAX_BATCH = 1000



def _check_cap(name: str, value: object, hard_cap: timedelta) -> timedelta:
    try:
        return normalize_ttl(name, value, hard_cap)
    except InvalidInput as bad:
        raise ConfigurationError(
            f"{bad} (options may only tighten the {hard_cap.total_seconds():g} s cap)"
        ) from None


def _check_handle(lease: object) -> LeaseHandle:
    """Check every field of a (possibly hand-built) handle and return it rebuilt from plain,
    normalized values, so nothing a caller subclassed takes part in a fencing comparison."""
    if not isinstance(lease, LeaseHandle):
        raise InvalidInput("lease", f"must be a LeaseHandle, not {type(lease).__name__}")
    lease_id = lease.lease_id
    if not isinstance(lease_id, UUID):
        raise InvalidInput("lease.lease_id", "must be a UUID")
    identity = check_identity("lease.identity", lease.identity)
    connector_id = check_id("lease.connector_id", lease.connector_id)
    if type(lease_id) is not UUID:
        lease_id = UUID(int=int.__index__(lease_id.int))
    epoch = check_epoch("lease.epoch", lease.epoch)
    scopes = normalize_scopes("lease.scopes", lease.scopes)
    return LeaseHandle(identity=identity, connector_id=connector_id, lease_id=lease_id,
                       epoch=epoch, scopes=scopes, expires_at=lease.expires_at)


def _holder_view(row: LeaseRow, now: datetime) -> HolderView:
    return HolderView(connector_id=row.connector_id, epoch=row.epoch, state=row.state(now),
                      expires_at=row.expires_at, now=now)


def _is_own_write(command: Command, row: LeaseRow | None) -> bool:
    return (row is not None and isinstance(command, Acquire | Takeover)
            and row.lease_id == command.new_lease_id)


def _check_adapter(adapter: object) -> None:
    if not callable(adapter):
        raise InvalidInput("adapter", f"must be callable, not {type(adapter).__name__}")


class _Flows:
    """Every operation of the coordinator, independent of how the store is called."""

    def __init__(
        self,
        policy: ConnectorLeaseService | None,
        *,
        lease_ttl_cap: timedelta | float,
        grant_ttl_cap: timedelta | float,
        id_source: IdSource,
        max_conflict_retries: int,
        monotonic_clock: MonotonicClock,
    ) -> None:
        if policy is not None and (isinstance(policy, type)
                                   or not isinstance(policy, ConnectorLeaseService)):
            raise ConfigurationError(
                f"policy must be a ConnectorLeaseService instance, not {type(policy).__name__}")
        if not callable(id_source):
            raise ConfigurationError("id_source must be a callable returning UUIDs")
        if not callable(monotonic_clock):
            raise ConfigurationError("monotonic_clock must be a callable returning seconds")
        self.policy: ConnectorLeaseService = DenyAllPolicy() if policy is None else policy
        self.lease_ttl_cap = _check_cap("lease_ttl_cap", lease_ttl_cap, LEASE_TTL_CAP)
        self.grant_ttl_cap = _check_cap("grant_ttl_cap", grant_ttl_cap, GRANT_TTL_CAP)
        if isinstance(max_conflict_retries, bool) or not isinstance(max_conflict_retries, int) \
                or not 0 <= max_conflict_retries <= 100:
            raise ConfigurationError("max_conflict_retries must be an int in 0..100")
        self.max_conflict_retries = max_conflict_retries
        if policy is None:  # once the arguments are known to be good
            # Deny-all is the safe default, but on its own it looks like a broken gateway.
            log.warning("coordinator built without a policy: the default DenyAllPolicy "
                        "refuses every lease and grant operation; pass policy= (e.g. "
                        "StaticConnectorPolicy.from_dict(...)) to allow any")
        self._ids = id_source
        self._monotonic = monotonic_clock
        self._grants = GrantRegistry()
        self._views = ViewRegistry()

    @property
    def live_grants(self) -> int:
        """How many grants this instance currently remembers (bounded by expiry)."""
        return len(self._grants)

    def _correlation(self, correlation_id: object, event_id: UUID) -> str:
        # Without one from the caller, the attempt's own audit event id serves: it is unique
        # already, and one random id per call fewer is measurable on the hot path.
        given = check_correlation_id("correlation_id", correlation_id)
        return given if given is not None else event_id.hex

    def _verdict(self, request: PolicyRequest) -> PolicyVerdict:
        verdict = self.policy.authorize(request)
        if not isinstance(verdict, PolicyVerdict):
            raise ConfigurationError(
                f"policy returned {type(verdict).__name__}, expected PolicyVerdict")
        return verdict

    # -- lifecycle --------------------------------------------------------------------------

    def acquire(self, identity: LeaseIdentity, connector_id: str, scopes: object,
                ttl: timedelta | float, correlation_id: str | None) -> Flow[LeaseResult]:
        identity = check_identity("identity", identity)
        connector_id = check_id("connector_id", connector_id)
        norm_scopes = normalize_scopes("scopes", scopes)
        norm_ttl = normalize_ttl("ttl", ttl, self.lease_ttl_cap)
        event_id = self._ids()
        command = Acquire(identity, connector_id, norm_scopes, norm_ttl, self._ids(),
                          event_id, self._correlation(correlation_id, event_id))
        verdict = self._verdict(PolicyRequest(LifecycleEvent.ACQUIRE, identity, connector_id,
                                              norm_scopes, norm_ttl))
        return (yield from self._lifecycle(command, verdict, None))

    def takeover(self, identity: LeaseIdentity, connector_id: str, scopes: object,
                 ttl: timedelta | float, expected_epoch: int, correlation_id: str | None,
                 observed: object = None) -> Flow[LeaseResult]:
        identity = check_identity("identity", identity)
        connector_id = check_id("connector_id", connector_id)
        norm_scopes = normalize_scopes("scopes", scopes)
        norm_ttl = normalize_ttl("ttl", ttl, self.lease_ttl_cap)
        expected_epoch = check_epoch("expected_epoch", expected_epoch)
        view = self._views.check(observed, identity, expected_epoch)
        event_id = self._ids()
        correlation = self._correlation(correlation_id, event_id)
        # The policy is told the lease's state and holder, so a takeover reads before it
        # writes, unless the caller passes what this coordinator just showed it at this
        # epoch. Either is safe to act on: at one epoch the holder never changes and the
        # state only moves from active to expired or released, and the write's guard
        # re-checks both the epoch and (without preemption) that the lease is not active.
        snapshot: Snapshot | None = None
        if view is None:
            snapshot = yield Load(identity)
            view = None if snapshot.row is None else _holder_view(snapshot.row, snapshot.now)
        verdict = self._verdict(PolicyRequest(
            LifecycleEvent.TAKEOVER, identity, connector_id, norm_scopes, norm_ttl,
            current_state=None if view is None else view.state,
            current_connector_id=None if view is None else view.connector_id,
        ))
        command = Takeover(identity, connector_id, norm_scopes, norm_ttl, expected_epoch,
                           preempt_active=preempts(verdict, None if view is None else view.state),
                           new_lease_id=self._ids(), event_id=event_id,
                           correlation_id=correlation)
        return (yield from self._lifecycle(command, verdict, snapshot))

    def heartbeat(self, lease: LeaseHandle, ttl: timedelta | float,
                  correlation_id: str | None) -> Flow[LeaseResult]:
        lease = _check_handle(lease)
        norm_ttl = normalize_ttl("ttl", ttl, self.lease_ttl_cap)
        event_id = self._ids()
        command = Heartbeat(lease.identity, lease.connector_id, lease.lease_id, lease.epoch,
                            norm_ttl, event_id, self._correlation(correlation_id, event_id))
        verdict = self._verdict(PolicyRequest(LifecycleEvent.HEARTBEAT, lease.identity,
                                              lease.connector_id, lease.scopes, norm_ttl))
        return (yield from self._lifecycle(command, verdict, None))

    def release(self, lease: LeaseHandle, correlation_id: str | None) -> Flow[LeaseResult]:
        lease = _check_handle(lease)
        event_id = self._ids()
        command = Release(lease.identity, lease.connector_id, lease.lease_id, lease.epoch,
                          event_id, self._correlation(correlation_id, event_id))
        verdict = self._verdict(PolicyRequest(LifecycleEvent.RELEASE, lease.identity,
                                              lease.connector_id, lease.scopes, None))
        return (yield from self._lifecycle(command, verdict, None))

    def _lifecycle(self, command: Acquire | Takeover | Heartbeat | Release,
                   verdict: PolicyVerdict, snapshot: Snapshot | None) -> Flow[LeaseResult]:
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

    def _read_decide_write(self, command: Acquire | Takeover | Heartbeat | Release,
                           verdict: PolicyVerdict,
                           snapshot: Snapshot | None) -> Flow[LeaseResult]:
        """Read, decide, write; on losing a race between read and write, read again."""
        for _ in range(self.max_conflict_retries + 1):
            if snapshot is None:
                snapshot = yield Load(command.identity)
            if _is_own_write(command, snapshot.row):
                # A write of ours whose reply was lost committed after all (lease ids are
                # generated before the write and never reused, so the row names its writer).
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
            return (yield Apply(write, entry))  # type: ignore[no-any-return]
        except CommitOutcomeUnknown:
            return (yield from self._reconcile_write(command, write, entry.event_id))

    def _reconcile_write(self, command: Command, write: Write,
                         event_id: UUID) -> Flow[WriteOutcome]:
        """The write may or may not have committed. Its audit row exists exactly when it did,
        so ask for that row instead of retrying blindly: a blind takeover retry would fail
        against our own new epoch, or worse, be mistaken for someone else's."""
        try:
            committed: bool = yield Committed(event_id)
            snapshot: Snapshot = yield Load(command.identity)
        except StoreUnavailable as down:
            raise CommitOutcomeUnknown(event_id, str(down)) from down
        log.warning("mos_lease: %s %s outcome reconciled: committed=%s", event_of(command),
                    command.identity, committed)
        if not committed:
            return WriteOutcome(None, snapshot.now, reconciled=True)
        return WriteOutcome(self._reconciled_row(command, write, snapshot), snapshot.now,
                            reconciled=True)

    @staticmethod
    def _reconciled_row(command: Command, write: Write, snapshot: Snapshot) -> LeaseRow:
        """The row our committed write produced, as far as it can still be known."""
        row = snapshot.row
        assert row is not None  # our write committed and rows are never deleted
        lease_id = write.new_lease_id if isinstance(write, Rotate) else (
            write.lease_id if isinstance(write, Insert | Renew | Close) else row.lease_id)
        epoch = success_epoch(command)
        if row.lease_id == lease_id and row.epoch == epoch:
            return row
        # Superseded since: report the write, with an expiry that is already over.
        assert epoch is not None
        return attrs.evolve(row, lease_id=lease_id, epoch=epoch,
                            connector_id=command.connector_id, expires_at=snapshot.now)

    def _success(self, command: Command, outcome: WriteOutcome) -> LeaseResult:
        assert outcome.row is not None
        return LeaseResult(success_outcome(command), None,
                           command.correlation_id, lease=LeaseHandle.of(outcome.row),
                           current_epoch=outcome.row.epoch, reconciled=outcome.reconciled)

    def _deny(self, command: Command, reason: Reason | None,
              snapshot: Snapshot | None) -> Flow[LeaseResult]:
        """A denial; ``snapshot`` is the read that named a state-based one (``None`` for the
        policy's refusals, which reveal nothing about the lease)."""
        assert reason is not None
        yield Record(audit_entry(command, reason, presented_epoch(command)))
        log.info("mos_lease: %s denied for %s connector=%s reason=%s", event_of(command),
                 command.identity, command.connector_id, reason)
        row = None if snapshot is None else snapshot.row
        if row is None:
            return LeaseResult(Outcome.DENIED, reason, command.correlation_id)
        assert snapshot is not None
        return LeaseResult(Outcome.DENIED, reason, command.correlation_id,
                           current_epoch=row.epoch,
                           holder=self._views.issue(_holder_view(row, snapshot.now),
                                                    command.identity))

    def heartbeat_many(self, leases: object, ttl: timedelta | float,
                       correlation_id: str | None) -> Flow[list[LeaseResult]]:
        if isinstance(leases, LeaseHandle | str | bytes) or not isinstance(leases, Sequence):
            raise InvalidInput("leases", "must be a sequence of LeaseHandle")
        if len(leases) > MAX_BATCH:
            raise InvalidInput("leases", f"at most {MAX_BATCH} leases per batch")
        handles = [_check_handle(lease) for lease in leases]
        norm_ttl = normalize_ttl("ttl", ttl, self.lease_ttl_cap)
        correlation = self._correlation(correlation_id, self._ids())
        commands = [Heartbeat(h.identity, h.connector_id, h.lease_id, h.epoch, norm_ttl,
                              self._ids(), correlation) for h in handles]
        verdicts = [self._verdict(PolicyRequest(LifecycleEvent.HEARTBEAT, h.identity,
                                                h.connector_id, h.scopes, norm_ttl))
                    for h in handles]
        results: list[LeaseResult | None] = [None] * len(commands)
        pending = []
        for i, (command, verdict) in enumerate(zip(commands, verdicts, strict=True)):
            if verdict.allowed:
                pending.append(i)
            else:
                results[i] = yield from self._deny(command, verdict.reason, None)
        # One round trip for every renewal; each is still guarded and audited on its own,
        # and a refused one does not hold back the others.
        writes = [(Renew(c.identity, c.connector_id, c.lease_id, c.epoch, c.ttl),
                   audit_entry(c, None, c.epoch)) for c in (commands[i] for i in pending)]
        outcomes: list[WriteOutcome] | None = None
        if writes:
            try:
                outcomes = list((yield RenewMany(tuple(writes))))
            except CommitOutcomeUnknown:
                outcomes = None
        for k, i in enumerate(pending):
            write, entry = writes[k]
            outcome = (outcomes[k] if outcomes is not None else
                       (yield from self._reconcile_write(commands[i], write, entry.event_id)))
            results[i] = (self._success(commands[i], outcome) if outcome.row is not None
                          else (yield from self._read_decide_write(commands[i], verdicts[i], None)))
        return [r for r in results if r is not None]

    # -- grants -----------------------------------------------------------------------------

    def issue_grant(self, lease: LeaseHandle, scopes: object, ttl: timedelta | float,
                    correlation_id: str | None) -> Flow[GrantResult]:
        lease = _check_handle(lease)
        norm_scopes = normalize_scopes("scopes", scopes)
        norm_ttl = normalize_ttl("ttl", ttl, self.grant_ttl_cap)
        event_id = self._ids()
        command = IssueGrant(lease.identity, lease.connector_id, lease.lease_id, lease.epoch,
                             norm_scopes, norm_ttl, event_id,
                             self._correlation(correlation_id, event_id))
        verdict = self._verdict(PolicyRequest(LifecycleEvent.GRANT_ISSUE, lease.identity,
                                              lease.connector_id, norm_scopes, norm_ttl))
        row = None
        if verdict.allowed:
            # Reread the durable current lease: a grant is never minted from a cached view.
            snapshot: Snapshot = yield Load(lease.identity)
            row, now = snapshot.row, snapshot.now
            decision = decide(row, now, command, verdict)
        else:
            decision = decide(None, datetime.min, command, verdict)
        yield Record(decision.audit)
        if decision.reason is not None:
            log.info("mos_lease: grant denied for %s connector=%s reason=%s", lease.identity,
                     lease.connector_id, decision.reason)
            return GrantResult(Outcome.DENIED, decision.reason, command.correlation_id)
        assert row is not None
        grant = self._grants.mint(
            self._ids(), lease.identity, lease.connector_id, lease.lease_id, lease.epoch,
            norm_scopes, grant_expiry(row, now, norm_ttl), command.correlation_id, now)
        return GrantResult(Outcome.GRANT_ISSUED, None, command.correlation_id, grant)

    def validate(self, grant: object, identity: LeaseIdentity, scopes: object,
                 correlation_id: str | None) -> Flow[ValidationResult]:
        identity = check_identity("identity", identity)
        requested = normalize_scopes("scopes", scopes)
        fallback_correlation = check_correlation_id("correlation_id", correlation_id)
        registry_reason = self._grants.check(grant)
        if registry_reason is Reason.GRANT_UNKNOWN:
            # Nothing in an unrecognized object is trusted, not even for the audit row.
            return (yield from self._deny_validation(
                Reason.GRANT_UNKNOWN, identity, "unrecognized", None,
                fallback_correlation or self._ids().hex))
        assert isinstance(grant, ExecutionGrant)
        command = Validate(identity, requested, grant.identity, grant.connector_id,
                           grant.lease_id, grant.epoch, grant.scopes, grant.expires_at,
                           registry_reason, grant.correlation_id)
        reason = validation_refusal_unread(command)
        if reason is None:
            sent = self._monotonic()
            try:
                snapshot: Snapshot = yield Load(grant.identity)
            except StoreUnavailable:
                # Fail closed. The audit append below is best effort: the store that could
                # not be read may not take a write either, and then the log line is the record.
                log.warning("mos_lease: validation denied for %s: store unavailable", identity)
                reason = Reason.STORE_UNAVAILABLE
            else:
                self._grants.prune(snapshot.now)
                row, in_flight = snapshot.row, self._monotonic() - sent
                reason = validation_refusal(command, row, snapshot.now, in_flight)
                if reason is None:
                    assert row is not None
                    return ValidationResult(None, ConnectorExecutionContext(
                        identity=grant.identity, connector_id=grant.connector_id,
                        lease_id=grant.lease_id, epoch=grant.epoch, scopes=requested,
                        expires_at=context_expiry(command, row),
                        correlation_id=grant.correlation_id))
                if row is not None and context_expiry(command, row) > snapshot.now \
                        and reason in (Reason.GRANT_EXPIRED, Reason.LEASE_EXPIRED):
                    # Valid when read: the reply took longer than the validity it reported.
                    log.warning("mos_lease: validation reply for %s took %.3f s, past the "
                                "validity it reported", identity, in_flight)
        return (yield from self._deny_validation(reason, identity, grant.connector_id,
                                                 grant.epoch, grant.correlation_id))

    def _deny_validation(self, reason: Reason, identity: LeaseIdentity, connector_id: str,
                         epoch: int | None, correlation_id: str) -> Flow[ValidationResult]:
        entry = validation_audit(self._ids(), reason, identity, connector_id, epoch,
                                 correlation_id)
        log.info("mos_lease: validation denied for %s connector=%s reason=%s", identity,
                 connector_id, reason)
        try:
            yield Record(entry)
        except (StoreUnavailable, CommitOutcomeUnknown):
            # The refusal stands whether or not its audit row made it.
            log.warning("mos_lease: could not audit denied validation %s", entry.event_id)
        return ValidationResult(reason)

    def current_holder(self, identity: LeaseIdentity) -> Flow[HolderView | None]:
        # A plain read: no policy call and no audit row, since it changes nothing and
        # reveals nothing that could act on the lease (no lease UUID, no scopes).
        identity = check_identity("identity", identity)
        snapshot: Snapshot = yield Load(identity)
        row = snapshot.row
        return None if row is None else self._views.issue(_holder_view(row, snapshot.now),
                                                           identity)

    def reconcile(self, identity: LeaseIdentity, event_id: UUID) -> Flow[bool]:
        check_identity("identity", identity)
        if not isinstance(event_id, UUID):
            raise InvalidInput("event_id", "must be a UUID")
        return (yield Committed(event_id))  # type: ignore[no-any-return]


def _call(store: LeaseStore, op: Op) -> object:
    if isinstance(op, Load):
        return store.load(op.identity)
    if isinstance(op, Apply):
        return store.apply(op.write, op.entry)
    if isinstance(op, RenewMany):
        return store.renew_many(op.items)
    if isinstance(op, Record):
        store.record(op.entry)
        return None
    return store.event_committed(op.event_id)


async def _acall(store: AsyncLeaseStore, op: Op) -> object:
    if isinstance(op, Load):
        return await store.load(op.identity)
    if isinstance(op, Apply):
        return await store.apply(op.write, op.entry)
    if isinstance(op, RenewMany):
        return await store.renew_many(op.items)
    if isinstance(op, Record):
        await store.record(op.entry)
        return None
    return await store.event_committed(op.event_id)


_OP_NAMES: Final[dict[type, str]] = {Load: "load", Apply: "apply", RenewMany: "renew_many",
                                      Record: "record", Committed: "event_committed"}


class _Observation:
    """The telemetry of one operation, for whichever driver runs it with a hook attached.

    Which lifecycle attempts an operation made, and how each ended, is read from the audit
    entries its flow hands the store: an attempt's entries share its event id, and the last
    one handed over is the one that stood (a write that lost a race is followed by the
    retry's write or by the refusal). The flows themselves stay untouched, so an operation
    without a hook runs exactly the code it ran before.
    """

    __slots__ = ("_began", "_clock", "_emit", "_entries", "_system")

    def __init__(self, emit: Emitter, clock: MonotonicClock, system: str) -> None:
        self._emit = emit
        self._clock = clock
        self._system = system
        self._entries: dict[UUID, AuditEntry] = {}
        self._began = clock()

    def start(self, op: Op) -> tuple[int, float]:
        """Note ``op``'s audit entries; return the wall and monotonic times it starts at."""
        if isinstance(op, Apply | Record):
            self._entries[op.entry.event_id] = op.entry
        elif isinstance(op, RenewMany):
            for _write, entry in op.items:
                self._entries[entry.event_id] = entry
        return time.time_ns(), self._clock()

    def called(self, op: Op, started: tuple[int, float], error: BaseException | None) -> None:
        wall, began = started
        self._emit(StoreCall(_OP_NAMES[type(op)], self._system, wall, self._clock() - began,
                             None if error is None else type(error).__name__,
                             len(op.items) if isinstance(op, RenewMany) else 1))

    def finish(self, result: object) -> None:
        duration = self._clock() - self._began
        for entry in self._entries.values():
            self._emit(OperationFinished.of(entry, duration))
        if isinstance(result, ValidationResult) and result.context is not None:
            # A successful validation writes no audit row, but it is the hottest operation
            # and its latency is what a dashboard most wants.
            ctx = result.context
            identity = ctx.identity
            self._emit(OperationFinished(
                LifecycleEvent.GRANT_VALIDATE, identity.tenant_id, identity.logical_agent_id,
                identity.binding_id, ctx.connector_id, ctx.epoch, Outcome.VALIDATED, None,
                duration, ctx.correlation_id))


class _ObservedDrive(Drive[Op, T]):
    """A :class:`Drive` that reports each store call and the operation's end to telemetry."""

    __slots__ = ("_op", "_seen", "_started")

    def __init__(self, flow: Flow[T], seen: _Observation) -> None:
        self._seen = seen
        super().__init__(flow)

    def __next__(self) -> Op:
        self._op = super().__next__()
        self._started = self._seen.start(self._op)
        return self._op

    def send(self, outcome: object) -> None:
        self._seen.called(self._op, self._started,
                          outcome.error if isinstance(outcome, Failed) else None)
        super().send(outcome)

    def _finished(self, value: T) -> None:
        self._seen.finish(value)


class _Coordinator(Generic[S]):
    """What both coordinators share: the flows, the options and the process they live in."""

    def __init__(
        self,
        store: S,
        policy: ConnectorLeaseService | None = None,
        *,
        lease_ttl_cap: timedelta | float = LEASE_TTL_CAP,
        grant_ttl_cap: timedelta | float = GRANT_TTL_CAP,
        id_source: IdSource = uuid.uuid4,
        max_conflict_retries: int = DEFAULT_MAX_CONFLICT_RETRIES,
        monotonic_clock: MonotonicClock = default_clock,
        on_event: EventHook | None = None,
    ) -> None:
        self.store = store
        self._emit = emitter(on_event)
        self._flows = _Flows(policy, lease_ttl_cap=lease_ttl_cap, grant_ttl_cap=grant_ttl_cap,
                             id_source=id_source, max_conflict_retries=max_conflict_retries,
                             monotonic_clock=monotonic_clock)
        self._system = store_system(store)
        # Whether the store counts its calls' bounds from SHARED_START (operation.py).
        self._shares_bound = getattr(store, "shares_bound", False) is True
        self._pid = os.getpid()

    def _drive(self, flow: Flow[T]) -> Drive[Op, T]:
        if self._emit is None:  # the one check telemetry costs when nothing listens
            return Drive(flow)
        return _ObservedDrive(flow, _Observation(self._emit, self._flows._monotonic,
                                                 self._system))

    @property
    def monotonic(self) -> MonotonicClock:
        """The monotonic clock this coordinator measures in-flight time on; keepers and
        holders built on it keep their deadlines on the same clock unless told otherwise."""
        return self._flows._monotonic

    @property
    def live_grants(self) -> int:
        """How many grants this instance remembers; expired ones are dropped."""
        return self._flows.live_grants

    def _foreign_process(self) -> bool:
        # Registries are wiped in a forked child; this also covers a coordinator object
        # that reached another process by any other route.
        if os.getpid() == self._pid:
            return False
        log.info("mos_lease: validation denied: coordinator used in another process than "
                 "the one that built it (reason=%s)", Reason.GRANT_UNKNOWN)
        return True


class ConnectorLeaseCoordinator(_Coordinator[LeaseStore]):
    """Synchronous coordinator. One instance per gateway process.

    ``store`` is the lease store (``mos_lease_memory.InMemoryLeaseStore`` in one process,
    ``mos_lease_pg.PostgresLeaseStore`` across processes); ``policy`` defaults to deny-all.
    The TTL caps (5 minutes for leases, 30 seconds for grants) may only be lowered. Other keyword
    options are those of :class:`AsyncConnectorLeaseCoordinator`. ``on_event`` (default
    ``None``) is called with a :mod:`mos_lease.events` event for every store call and every
    finished lifecycle attempt or validation (``docs/telemetry.md``).
    """

    def __init__(self, store: LeaseStore,
                 policy: ConnectorLeaseService | None = None, **options: Any) -> None:
        super().__init__(store, policy, **options)

    def _run(self, flow: Flow[T]) -> T:
        drive = self._drive(flow)
        for op in drive:
            drive.send(outcome_of(_call, self.store, op))
        return drive.result

    def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                ttl: timedelta | float, correlation_id: str | None = None) -> LeaseResult:
        """Insert-only first acquisition (epoch 1). Never recovers an expired or released
        lease: that needs :meth:`takeover`."""
        return self._run(self._flows.acquire(identity, connector_id, scopes, ttl,
                                             correlation_id))

    def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                 ttl: timedelta | float, expected_epoch: int,
                 correlation_id: str | None = None,
                 observed: HolderView | None = None) -> LeaseResult:
        """Compare-and-set on ``expected_epoch``: rotates the lease id, epoch + 1.

        The policy is told the lease's current state and holder, which costs a read before
        the write, unless ``observed`` is the :class:`HolderView` this coordinator just
        returned for the identity at ``expected_epoch`` (``current_holder()``, or a refused
        acquire's ``result.holder``): then the takeover is one round trip."""
        return self._run(self._flows.takeover(identity, connector_id, scopes, ttl,
                                              expected_epoch, correlation_id, observed))

    def heartbeat(self, lease: LeaseHandle, *, ttl: timedelta | float,
                  correlation_id: str | None = None) -> LeaseResult:
        """Extend an active lease to store time + ``ttl``; full match on every field."""
        return self._run(self._flows.heartbeat(lease, ttl, correlation_id))

    def heartbeat_many(self, leases: Sequence[LeaseHandle], *, ttl: timedelta | float,
                       correlation_id: str | None = None) -> list[LeaseResult]:
        """Renew many leases in one store round trip; results are in the order given, and
        each lease is matched, refused and audited on its own."""
        return self._run(self._flows.heartbeat_many(leases, ttl, correlation_id))

    def release(self, lease: LeaseHandle, *, correlation_id: str | None = None) -> LeaseResult:
        """Release an active lease, keeping its epoch; only a takeover follows it."""
        return self._run(self._flows.release(lease, correlation_id))

    def issue_grant(self, lease: LeaseHandle, *, scopes: object, ttl: timedelta | float,
                    correlation_id: str | None = None) -> GrantResult:
        """Mint a short-lived, process-local grant after rereading the current lease."""
        return self._run(self._flows.issue_grant(lease, scopes, ttl, correlation_id))

    def validate(self, grant: ExecutionGrant, *, identity: LeaseIdentity, scopes: object,
                 correlation_id: str | None = None) -> ValidationResult:
        """Check ``grant`` against the store right now, for work on ``identity`` needing
        ``scopes``. Prefer :meth:`invoke`, which leaves no gap before the adapter runs."""
        if self._foreign_process():
            return ValidationResult(Reason.GRANT_UNKNOWN)
        # The read and a denial's audit append share one bound (operation.py); set and
        # reset inline rather than through a context manager: this is the hottest call.
        if not self._shares_bound:
            return self._run(self._flows.validate(grant, identity, scopes, correlation_id))
        started = SHARED_START.set(time.monotonic())
        try:
            return self._run(self._flows.validate(grant, identity, scopes, correlation_id))
        finally:
            SHARED_START.reset(started)

    def invoke(self, grant: ExecutionGrant, adapter: Callable[[ConnectorExecutionContext], T],
               *, identity: LeaseIdentity, scopes: object,
               correlation_id: str | None = None) -> InvocationResult[T]:
        """Validate, then call ``adapter`` with the context and nothing else."""
        _check_adapter(adapter)
        checked = self.validate(grant, identity=identity, scopes=scopes,
                                correlation_id=correlation_id)
        if checked.context is None:
            return InvocationResult(checked.reason)
        return InvocationResult(None, checked.context, adapter(checked.context))

    def current_holder(self, identity: LeaseIdentity) -> HolderView | None:
        """Who holds ``identity``'s lease now (``None`` if it never had one). A read: no
        audit row, no lease UUID, no scopes."""
        return self._run(self._flows.current_holder(identity))

    def reconcile(self, identity: LeaseIdentity, event_id: UUID) -> bool:
        """Whether the write behind a :class:`CommitOutcomeUnknown` took effect."""
        return self._run(self._flows.reconcile(identity, event_id))


class AsyncConnectorLeaseCoordinator(_Coordinator[AsyncLeaseStore]):
    """The asyncio coordinator: the same flows, driven against an :class:`AsyncLeaseStore`."""

    def __init__(self, store: AsyncLeaseStore,
                 policy: ConnectorLeaseService | None = None, **options: Any) -> None:
        super().__init__(store, policy, **options)

    async def _run(self, flow: Flow[T]) -> T:
        drive = self._drive(flow)
        for op in drive:
            drive.send(await outcome_of_async(_acall, self.store, op))
        return drive.result

    async def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                      ttl: timedelta | float, correlation_id: str | None = None) -> LeaseResult:
        """Insert-only first acquisition (epoch 1); as
        :meth:`ConnectorLeaseCoordinator.acquire`."""
        return await self._run(self._flows.acquire(identity, connector_id, scopes, ttl,
                                                   correlation_id))

    async def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                       ttl: timedelta | float, expected_epoch: int,
                       correlation_id: str | None = None,
                       observed: HolderView | None = None) -> LeaseResult:
        """Compare-and-set on ``expected_epoch``: rotates the lease id, epoch + 1; as
        :meth:`ConnectorLeaseCoordinator.takeover` (``observed``: the holder view this
        coordinator just returned, for a takeover in one round trip)."""
        return await self._run(self._flows.takeover(identity, connector_id, scopes, ttl,
                                                    expected_epoch, correlation_id, observed))

    async def heartbeat(self, lease: LeaseHandle, *, ttl: timedelta | float,
                        correlation_id: str | None = None) -> LeaseResult:
        """Extend an active lease to store time + ``ttl``; as
        :meth:`ConnectorLeaseCoordinator.heartbeat`."""
        return await self._run(self._flows.heartbeat(lease, ttl, correlation_id))

    async def heartbeat_many(self, leases: Sequence[LeaseHandle], *, ttl: timedelta | float,
                             correlation_id: str | None = None) -> list[LeaseResult]:
        """Renew many leases in one store round trip, each matched, refused and audited on
        its own; as :meth:`ConnectorLeaseCoordinator.heartbeat_many`."""
        return await self._run(self._flows.heartbeat_many(leases, ttl, correlation_id))

    async def release(self, lease: LeaseHandle, *,
                      correlation_id: str | None = None) -> LeaseResult:
        """Release an active lease, keeping its epoch; as
        :meth:`ConnectorLeaseCoordinator.release`."""
        return await self._run(self._flows.release(lease, correlation_id))

    async def issue_grant(self, lease: LeaseHandle, *, scopes: object, ttl: timedelta | float,
                          correlation_id: str | None = None) -> GrantResult:
        """Mint a short-lived, process-local grant after rereading the current lease; as
        :meth:`ConnectorLeaseCoordinator.issue_grant`."""
        return await self._run(self._flows.issue_grant(lease, scopes, ttl, correlation_id))

    async def validate(self, grant: ExecutionGrant, *, identity: LeaseIdentity, scopes: object,
                       correlation_id: str | None = None) -> ValidationResult:
        """Check ``grant`` against the store right now; as
        :meth:`ConnectorLeaseCoordinator.validate`. Prefer :meth:`invoke`."""
        if self._foreign_process():
            return ValidationResult(Reason.GRANT_UNKNOWN)
        if not self._shares_bound:
            return await self._run(self._flows.validate(grant, identity, scopes,
                                                        correlation_id))
        started = SHARED_START.set(time.monotonic())  # as in ConnectorLeaseCoordinator
        try:
            return await self._run(self._flows.validate(grant, identity, scopes,
                                                        correlation_id))
        finally:
            SHARED_START.reset(started)

    async def invoke(self, grant: ExecutionGrant,
                     adapter: Callable[[ConnectorExecutionContext], Awaitable[T]], *,
                     identity: LeaseIdentity, scopes: object,
                     correlation_id: str | None = None) -> InvocationResult[T]:
        """Validate ``grant`` for ``identity`` and ``scopes``, then await
        ``adapter(context)`` with the context and nothing else; a refusal returns an
        ``InvocationResult`` with its reason and never calls the adapter. As
        :meth:`ConnectorLeaseCoordinator.invoke`, for an adapter that returns an
        awaitable."""
        _check_adapter(adapter)
        checked = await self.validate(grant, identity=identity, scopes=scopes,
                                      correlation_id=correlation_id)
        if checked.context is None:
            return InvocationResult(checked.reason)
        return InvocationResult(None, checked.context, await adapter(checked.context))

    async def current_holder(self, identity: LeaseIdentity) -> HolderView | None:
        """Who holds ``identity``'s lease now (``None`` if it never had one). A read: no
        audit row, no lease UUID, no scopes."""
        return await self._run(self._flows.current_holder(identity))

    async def reconcile(self, identity: LeaseIdentity, event_id: UUID) -> bool:
        """Whether the write behind a :class:`CommitOutcomeUnknown` took effect."""
        return await self._run(self._flows.reconcile(identity, event_id))
