"""The pure lease state machine.

``decide(row, now, command, verdict)`` is the whole lifecycle: given the durable row (or
none), the store's time, a command and the policy's verdict it returns the outcome, the
denial reason, the guarded write to perform and the one audit entry that records the
attempt. It reads no clock, makes no ids (they arrive inside the command) and does no I/O.

Writes are *guarded*: each carries the condition under which the store may apply it
(``guard_holds``) and how it changes the row (``apply_write``). A store applies a write by
checking the guard against the row and its own time in the same atomic step; the in-memory
store calls these functions directly and the PostgreSQL store expresses the same guards in
SQL. Because a write is re-checked at the store, the coordinator may attempt it before
reading (one round trip on the success path) and call ``decide`` only to name a refusal.

The rules a grant is judged by (``identity_refusal``, ``grant_refusal``) are here too, since a
resource guard applies them as well; how a validation orders them around its read is in
:mod:`mos_lease.validation`, and how a write whose reply was lost is settled in
:mod:`mos_lease.reconciliation`.

The tables in ``specs/transitions.md`` are checked against this module by a test.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from uuid import UUID

import attrs

from mos_lease.identity import MAX_EPOCH, LeaseIdentity, Scopes
from mos_lease.metadata import EMPTY_METADATA, Metadata
from mos_lease.records import AuditEntry, LeaseRow
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome, Reason

# --- commands -----------------------------------------------------------------------------
# Every command carries the ids the coordinator generated for it before any write, so the
# audit row (``event_id``) and a new lease (``new_lease_id``) can be found again when the
# outcome of a commit is unknown.


@attrs.frozen(slots=True)
class Acquire:
    identity: LeaseIdentity
    connector_id: str
    scopes: Scopes
    ttl: timedelta
    new_lease_id: UUID
    event_id: UUID
    correlation_id: str
    # What the new holder says of itself (mos_lease.metadata); set on the row it creates.
    metadata: Metadata = EMPTY_METADATA


@attrs.frozen(slots=True)
class Takeover:
    identity: LeaseIdentity
    connector_id: str
    scopes: Scopes
    ttl: timedelta
    expected_epoch: int
    # Set by the coordinator from the policy: True only when the policy was told the lease
    # is active and still allowed the takeover.
    preempt_active: bool
    new_lease_id: UUID
    event_id: UUID
    correlation_id: str
    # Replaces the row's metadata (none given: the row's becomes empty).
    metadata: Metadata = EMPTY_METADATA


@attrs.frozen(slots=True)
class Heartbeat:
    identity: LeaseIdentity
    connector_id: str
    lease_id: UUID
    epoch: int
    ttl: timedelta
    event_id: UUID
    correlation_id: str


@attrs.frozen(slots=True)
class Release:
    identity: LeaseIdentity
    connector_id: str
    lease_id: UUID
    epoch: int
    event_id: UUID
    correlation_id: str


@attrs.frozen(slots=True)
class IssueGrant:
    identity: LeaseIdentity
    connector_id: str
    lease_id: UUID
    epoch: int
    scopes: Scopes
    ttl: timedelta
    event_id: UUID
    correlation_id: str


Command = Acquire | Takeover | Heartbeat | Release | IssueGrant

# --- writes -------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Insert:
    """Insert-only creation at epoch 1; the guard is "no row exists"."""

    identity: LeaseIdentity
    lease_id: UUID
    connector_id: str
    scopes: Scopes
    ttl: timedelta
    metadata: Metadata = EMPTY_METADATA


@attrs.frozen(slots=True)
class Renew:
    """Heartbeat: full match on an active lease; moves expiry to ``now + ttl``."""

    identity: LeaseIdentity
    connector_id: str
    lease_id: UUID
    epoch: int
    ttl: timedelta


@attrs.frozen(slots=True)
class Close:
    """Release: full match on an active lease; keeps the epoch."""

    identity: LeaseIdentity
    connector_id: str
    lease_id: UUID
    epoch: int


@attrs.frozen(slots=True)
class Rotate:
    """Takeover: compare-and-set on the expected epoch. Rotates the lease id and raises the
    epoch by one in the same write. Epoch and lease id change together, so the epoch alone
    names the lease being replaced."""

    identity: LeaseIdentity
    expected_epoch: int
    preempt_active: bool
    new_lease_id: UUID
    connector_id: str
    scopes: Scopes
    ttl: timedelta
    metadata: Metadata = EMPTY_METADATA


Write = Insert | Renew | Close | Rotate


def write_refusal(write: Write, row: LeaseRow | None, now: datetime) -> Reason | None:
    """Why the store may not apply ``write`` to ``row`` at store time ``now`` (``None``: it
    may). The one description of every guard: :func:`guard_holds` is "no refusal", a
    lifecycle command is refused for exactly its write's reason, and the PostgreSQL store
    states the same conditions in SQL (checked against this function by its tests)."""
    if isinstance(write, Insert):
        if row is None:
            return None
        return (Reason.LEASE_HELD if row.state(now) is LeaseState.ACTIVE
                else Reason.TAKEOVER_REQUIRED)
    if isinstance(write, Renew | Close):
        reason = holder_refusal(row, now, write.connector_id, write.lease_id, write.epoch)
    elif row is None:
        return Reason.LEASE_MISSING
    elif row.epoch != write.expected_epoch:
        reason = Reason.EPOCH_MISMATCH
    elif row.epoch >= MAX_EPOCH:
        reason = Reason.EPOCH_EXHAUSTED
    elif row.state(now) is LeaseState.ACTIVE and not write.preempt_active:
        reason = Reason.PREEMPTION_DENIED
    else:
        reason = None
    return reason if reason is not None else clock_refusal(row, now)


def clock_refusal(row: LeaseRow | None, now: datetime) -> Reason | None:
    """Refuse a write that would otherwise apply if store time ``now`` is earlier than the
    row's latest stamp (``updated_at``: every write sets it, and no other stamp of a row is
    later). The store's clock stepped back (a failover to a host whose clock is behind, an
    NTP step): judged at such a time, an old holder could renew a lease that somebody already
    saw expire, and the row's times would run backwards. It comes last, so a stale or
    replaced holder still learns that, whatever the clock says; only a write that the
    clock alone would let through is refused for it. A step back shorter than the time since
    the row's last write leaves ``now`` after that stamp and is not seen here."""
    if row is not None and now < row.updated_at:
        return Reason.CLOCK_BEHIND
    return None


def guard_holds(write: Write, row: LeaseRow | None, now: datetime) -> bool:
    """Whether the store may apply ``write`` to ``row`` at store time ``now``."""
    return write_refusal(write, row, now) is None


def apply_write(write: Write, row: LeaseRow | None, now: datetime) -> LeaseRow:
    """The row after ``write``; only meaningful where ``guard_holds``."""
    if isinstance(write, Insert):
        return LeaseRow(
            identity=write.identity, lease_id=write.lease_id, connector_id=write.connector_id,
            scopes=write.scopes, epoch=1, acquired_at=now, heartbeat_at=now,
            expires_at=now + write.ttl, released_at=None, updated_at=now,
            metadata=write.metadata,
        )
    assert row is not None
    # A renewal and a release keep the holder's metadata: the row still says who held it.
    if isinstance(write, Renew):
        return attrs.evolve(row, heartbeat_at=now, expires_at=now + write.ttl, updated_at=now)
    if isinstance(write, Close):
        return attrs.evolve(row, released_at=now, updated_at=now)
    return LeaseRow(
        identity=row.identity, lease_id=write.new_lease_id, connector_id=write.connector_id,
        scopes=write.scopes, epoch=row.epoch + 1, acquired_at=now, heartbeat_at=now,
        expires_at=now + write.ttl, released_at=None, updated_at=now,
        metadata=write.metadata,
    )


def write_outcome(write: Write, row: LeaseRow | None, now: datetime) -> LeaseRow | None:
    """Apply ``write`` if its guard holds: the reference semantics every store must match."""
    return apply_write(write, row, now) if guard_holds(write, row, now) else None


# --- decisions ----------------------------------------------------------------------------


@attrs.frozen(slots=True)
class PolicyVerdict:
    """The policy's answer. ``reason`` is set exactly when ``allowed`` is false."""

    allowed: bool
    reason: Reason | None = None

    def __attrs_post_init__(self) -> None:
        if self.allowed != (self.reason is None):
            raise ValueError("a verdict has a reason exactly when it denies")


ALLOW = PolicyVerdict(True)


@attrs.frozen(slots=True)
class Decision:
    outcome: Outcome
    reason: Reason | None
    write: Write | None
    audit: AuditEntry

    @property
    def allowed(self) -> bool:
        return self.reason is None


_SUCCESS: dict[type[Command], tuple[LifecycleEvent, Outcome]] = {
    Acquire: (LifecycleEvent.ACQUIRE, Outcome.ACQUIRED),
    Takeover: (LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER),
    Heartbeat: (LifecycleEvent.HEARTBEAT, Outcome.RENEWED),
    Release: (LifecycleEvent.RELEASE, Outcome.RELEASED),
    IssueGrant: (LifecycleEvent.GRANT_ISSUE, Outcome.GRANT_ISSUED),
}


def event_of(command: Command) -> LifecycleEvent:
    return _SUCCESS[type(command)][0]


def success_outcome(command: Command) -> Outcome:
    return _SUCCESS[type(command)][1]


def presented_epoch(command: Command) -> int | None:
    """The epoch an audit row records for a refusal: the one the caller presented."""
    if isinstance(command, Acquire):
        return None
    if isinstance(command, Takeover):
        return command.expected_epoch
    return command.epoch


def audit_entry(command: Command, reason: Reason | None, epoch: int | None) -> AuditEntry:
    event, success = _SUCCESS[type(command)]
    outcome = Outcome.DENIED if reason is not None else success
    return AuditEntry(event_id=command.event_id, event=event, outcome=outcome, reason=reason,
                      identity=command.identity, connector_id=command.connector_id,
                      epoch=epoch, correlation_id=command.correlation_id)


def plan(command: Command) -> Write | None:
    """The guarded write ``command`` performs if it succeeds; ``None`` for grant issue."""
    if isinstance(command, Acquire):
        return Insert(command.identity, command.new_lease_id, command.connector_id,
                      command.scopes, command.ttl, command.metadata)
    if isinstance(command, Takeover):
        return Rotate(command.identity, command.expected_epoch, command.preempt_active,
                      command.new_lease_id, command.connector_id, command.scopes, command.ttl,
                      command.metadata)
    if isinstance(command, Heartbeat):
        return Renew(command.identity, command.connector_id, command.lease_id, command.epoch,
                     command.ttl)
    if isinstance(command, Release):
        return Close(command.identity, command.connector_id, command.lease_id, command.epoch)
    return None


def success_epoch(command: Command) -> int | None:
    """The epoch a successful ``command`` leaves the lease at, known before the write."""
    if isinstance(command, Acquire):
        return 1
    if isinstance(command, Takeover):
        return command.expected_epoch + 1
    return command.epoch


def written_epoch(write: Write) -> int:
    """The epoch ``write`` leaves the row at if it applies, known before it is sent (what
    :func:`success_epoch` is of the command that planned it)."""
    if isinstance(write, Insert):
        return 1
    if isinstance(write, Rotate):
        return write.expected_epoch + 1
    return write.epoch


def holder_refusal(
    row: LeaseRow | None, now: datetime, connector_id: str, lease_id: UUID, epoch: int
) -> Reason | None:
    """Why a holder's (connector, lease id, epoch) no longer names an active lease."""
    if row is None:
        return Reason.LEASE_MISSING
    if epoch < row.epoch:
        return Reason.STALE_EPOCH
    if epoch > row.epoch:
        return Reason.EPOCH_MISMATCH
    if lease_id != row.lease_id or connector_id != row.connector_id:
        return Reason.LEASE_REPLACED
    state = row.state(now)
    if state is LeaseState.RELEASED:
        return Reason.LEASE_RELEASED
    if state is LeaseState.EXPIRED:
        return Reason.LEASE_EXPIRED
    return None


def refusal(command: Command, row: LeaseRow | None, now: datetime) -> Reason | None:
    """The state-based reason ``command`` cannot proceed against ``row``, if any."""
    if isinstance(command, IssueGrant):
        reason = holder_refusal(row, now, command.connector_id, command.lease_id, command.epoch)
        if reason is None:
            assert row is not None
            if not set(command.scopes).issubset(row.scopes):
                return Reason.SCOPE_NOT_AUTHORIZED
        return reason
    write = plan(command)
    assert write is not None  # every lifecycle command but grant issue writes
    return write_refusal(write, row, now)


def preempts(verdict: PolicyVerdict, state: LeaseState | None) -> bool:
    """Whether a takeover may replace an *active* lease: only when the policy, told that the
    lease is active (``state``, as the policy was told it), still allowed it. An expired or
    released lease needs no preemption, and the write's guard holds the takeover to that:
    without preemption it succeeds only on a lease that is not active."""
    return verdict.allowed and state is LeaseState.ACTIVE


def decide(
    row: LeaseRow | None, now: datetime, command: Command, verdict: PolicyVerdict
) -> Decision:
    """The complete decision for one lifecycle attempt.

    The policy is consulted first: a caller the gateway does not authorize learns nothing
    about the lease's state from the reason it gets back.
    """
    reason = verdict.reason if not verdict.allowed else refusal(command, row, now)
    if reason is not None:
        return Decision(Outcome.DENIED, reason, None,
                        audit_entry(command, reason, presented_epoch(command)))
    return Decision(success_outcome(command), None, plan(command),
                    audit_entry(command, None, success_epoch(command)))


def grant_expiry(row: LeaseRow, now: datetime, ttl: timedelta) -> datetime:
    """A grant never outlives the lease it was minted under."""
    return min(now + ttl, row.expires_at)


def identity_refusal(granted: LeaseIdentity, target: LeaseIdentity) -> Reason | None:
    """A grant is usable only for the identity it was minted for."""
    if granted.tenant_id != target.tenant_id:
        return Reason.TENANT_MISMATCH
    if granted.logical_agent_id != target.logical_agent_id:
        return Reason.AGENT_MISMATCH
    if granted.binding_id != target.binding_id:
        return Reason.BINDING_MISMATCH
    return None


def grant_refusal(row: LeaseRow | None, now: datetime, *, connector_id: str, lease_id: UUID,
                  epoch: int, granted_scopes: Scopes, grant_expires_at: datetime,
                  requested: Scopes) -> Reason | None:
    """Why a (recognized, same-identity) grant may not be used now against ``row``."""
    if grant_expires_at <= now:
        return Reason.GRANT_EXPIRED
    reason = holder_refusal(row, now, connector_id, lease_id, epoch)
    if reason is not None:
        return reason
    assert row is not None
    wanted = set(requested)
    if not (wanted.issubset(granted_scopes) and wanted.issubset(row.scopes)):
        return Reason.SCOPE_NOT_AUTHORIZED
    return None
