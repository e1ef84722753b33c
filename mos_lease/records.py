"""Plain values that cross the boundary between the core, the coordinator and the stores."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

import attrs

from mos_lease.identity import LeaseIdentity, Scopes
from mos_lease.metadata import EMPTY_METADATA, Metadata
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome, Reason


@attrs.frozen(slots=True)
class LeaseRow:
    """The durable current lease of one identity: one row, never deleted.

    ``metadata`` is what the holder said of itself when it acquired or took over (see
    :mod:`mos_lease.metadata`); renewals and a release keep it. ``metadata_invalid``: the
    stored metadata breaks the rules every write passes (a row written around the library),
    so the store withheld it and ``metadata`` is empty
    (:func:`mos_lease.metadata.stored_metadata`)."""

    identity: LeaseIdentity
    lease_id: UUID
    connector_id: str
    scopes: Scopes
    epoch: int
    acquired_at: datetime
    heartbeat_at: datetime
    expires_at: datetime
    released_at: datetime | None
    updated_at: datetime
    metadata: Metadata = EMPTY_METADATA
    metadata_invalid: bool = False

    def state(self, now: datetime) -> LeaseState:
        """The row's state at ``now`` (the store's time): released, expired (``expires_at <=
        now``) or active."""
        if self.released_at is not None:
            return LeaseState.RELEASED
        if self.expires_at <= now:
            return LeaseState.EXPIRED
        return LeaseState.ACTIVE


@attrs.frozen(slots=True)
class LeaseHandle:
    """What the holder of a lease keeps: everything heartbeat, release and grant issue match.

    A handle is plain data, not a capability: the store matches every field against the
    durable row, so a handle for a replaced lease is refused.
    """

    identity: LeaseIdentity
    connector_id: str
    lease_id: UUID
    epoch: int
    scopes: Scopes
    expires_at: datetime

    @classmethod
    def of(cls, row: LeaseRow) -> LeaseHandle:
        """The handle for ``row``: the fields heartbeat, release and grant issue match."""
        return cls(row.identity, row.connector_id, row.lease_id, row.epoch, row.scopes,
                   row.expires_at)


@attrs.frozen(slots=True)
class AuditEntry:
    """One audit event as the coordinator asks for it; the store stamps the time.

    Deliberately has no field for scopes, grants, payloads, approval references, tokens or
    credentials: what is not here cannot leak into the log.
    """

    event_id: UUID
    event: LifecycleEvent
    outcome: Outcome
    reason: Reason | None
    identity: LeaseIdentity
    connector_id: str
    epoch: int | None
    correlation_id: str


@attrs.frozen(slots=True)
class AuditRecord:
    """An audit event as stored, read back for operators and tests."""

    seq: int
    entry: AuditEntry
    recorded_at: datetime


@attrs.frozen(slots=True)
class Snapshot:
    """A store read: the current row (or none) and the store's time in the same read."""

    row: LeaseRow | None
    now: datetime


@attrs.frozen(slots=True)
class WriteOutcome:
    """Result of a guarded write: the new row if the guard held, else ``None``.

    ``found``: when the guard did not hold, the row the write found (or none) at ``now``, if
    the store can tell it from the same atomic step; ``None`` if it cannot (the coordinator
    then reads the row to name the refusal). ``reconciled`` is set by the coordinator when
    the outcome was lost in transit and established afterwards by rereading; stores leave
    it false. ``reached`` is false when a batched renewal (``renew_many``) did not reach the
    row at all: another transaction held it locked, and a batch does not wait for one row
    (every other lease would wait with it). Nothing was judged or written, so it is neither
    a success nor a refusal; the lease is tried again later, as after any transient failure.
    """

    row: LeaseRow | None
    now: datetime
    reconciled: bool = False
    found: Snapshot | None = None
    reached: bool = True
