"""The rules of a grant's validation, in the order they are applied (pure: no I/O, no clock).

A validation is judged in three stages, split where the lease row is read:

1. before the read (:func:`validation_refusal_unread`): the grant is for this identity, then
   the registry still holds it;
2. the read itself: a store that cannot be read refuses (:func:`read_refusal` with no
   snapshot), since validation fails closed;
3. against the row (:func:`validation_refusal`): the grant's own expiry, the holder, the
   scopes, then the time the reply spent in flight.

``specs/transitions.md`` (section "Validation") lists these checks in this order, and
``tests/core/test_spec_table.py`` checks the two against each other.
"""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

import attrs

from mos_lease.identity import LeaseIdentity, Scopes
from mos_lease.machine import grant_refusal, identity_refusal
from mos_lease.records import AuditEntry, LeaseRow, Snapshot
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason


@attrs.define(slots=True)
class Validate:
    """Use of a recognized grant: act for ``identity`` with the ``requested`` scopes.

    The grant's facts arrive as fields (``granted_identity`` ... ``grant_expires_at``): the
    rules do not know the grant registry, only what it said about the grant object
    (``registry_reason``, e.g. an expired grant it already dropped). A validation has no
    write; only a refusal is audited, under an event id made when it is refused.

    Built for every validation and read by the rules only: a plain slotted class, not a
    frozen one (a frozen attrs instance costs about twice as much to build).
    """

    identity: LeaseIdentity
    requested: Scopes
    granted_identity: LeaseIdentity
    connector_id: str
    lease_id: UUID
    epoch: int
    granted_scopes: Scopes
    grant_expires_at: datetime
    registry_reason: Reason | None
    correlation_id: str


def validation_refusal_unread(command: Validate) -> Reason | None:
    """The checks of a validation that need no lease row, first in order: the grant is for
    this identity, then the registry accepts it. Only if both pass is the row read."""
    return identity_refusal(command.granted_identity, command.identity) or (
        command.registry_reason)


def read_refusal(command: Validate, read: Snapshot | None, in_flight: float) -> Reason | None:
    """The rest of a validation once the row was asked for: ``read`` is ``None`` when the
    store could not be read (``store_unavailable``: fail closed), else the row and store
    time it returned, judged by :func:`validation_refusal`."""
    if read is None:
        return Reason.STORE_UNAVAILABLE
    return validation_refusal(command, read.row, read.now, in_flight)


def validation_refusal(command: Validate, row: LeaseRow | None, now: datetime,
                       in_flight: float) -> Reason | None:
    """The rest of a validation against the row read at store time ``now``: the grant's and
    the lease's state (:func:`~mos_lease.machine.grant_refusal`), then time in flight.

    The reply says the context is valid for ``context_expiry - now`` from the instant the
    store read its clock, which lies somewhere between sending the read and receiving the
    reply. If at least that long (``in_flight`` seconds, measured by the caller) passed
    between the two, the validity may have run out before the caller could act on it:
    refuse, naming whichever expiry it was.
    """
    reason = grant_refusal(
        row, now, connector_id=command.connector_id, lease_id=command.lease_id,
        epoch=command.epoch, granted_scopes=command.granted_scopes,
        grant_expires_at=command.grant_expires_at, requested=command.requested)
    if reason is not None:
        return reason
    assert row is not None
    if in_flight < (context_expiry(command, row) - now).total_seconds():
        return None
    return (Reason.GRANT_EXPIRED if command.grant_expires_at <= row.expires_at
            else Reason.LEASE_EXPIRED)


def slow_reply(command: Validate, read: Snapshot | None, reason: Reason | None,
               in_flight: float) -> bool:
    """Whether refusal ``reason`` came from a reply that really arrived past the validity
    it reported (worth a warning: the store or the network is slower than the grants are
    long): the context was still valid at the store's instant ``read.now``, and the reply
    took at least that validity from the moment its statement went out.

    The refusal itself counts all of ``in_flight`` (the caller's whole wait), which is
    never shorter; the time the read waited in the store before its statement went out
    (``read.queued``: coalesced behind another read) came before the store read its clock,
    so a reply that was late only by it was answered in time, and is not warned about."""
    if read is None or read.row is None or reason not in (Reason.GRANT_EXPIRED,
                                                           Reason.LEASE_EXPIRED):
        return False
    validity = (context_expiry(command, read.row) - read.now).total_seconds()
    return validity > 0 and in_flight - read.queued >= validity


def context_expiry(command: Validate, row: LeaseRow) -> datetime:
    """A context is valid until the earlier of its grant's and its lease's expiry."""
    return min(command.grant_expires_at, row.expires_at)


def validation_audit(event_id: UUID, reason: Reason, identity: LeaseIdentity,
                     connector_id: str, epoch: int | None,
                     correlation_id: str) -> AuditEntry:
    """The audit entry of a refused validation (a successful one is not audited)."""
    return AuditEntry(event_id=event_id, event=LifecycleEvent.GRANT_VALIDATE,
                      outcome=Outcome.DENIED, reason=reason, identity=identity,
                      connector_id=connector_id, epoch=epoch, correlation_id=correlation_id)
