"""A write whose reply was lost: the rules that tell what it did (pure: no I/O, no clock).

A connection can drop after the commit was sent, so a write may have taken effect without
its caller learning so. Two facts settle it without a blind retry (which, for a takeover,
would fail against our own new epoch, or be taken for someone else's):

* the write's audit row exists with the write's own outcome exactly when the write committed
  (the store answers ``event_committed``). A refusal's row reuses the event id the refused
  write would have had, with outcome ``denied``: it exists although the write never
  happened, so the outcome, not the row's presence, is the answer (:func:`took_effect`);
* every lease id is made before the write that installs it and never reused, so a row
  carrying the new lease id of our acquire or takeover names us as its writer
  (:func:`is_own_write`).

What the caller is then told is :func:`reconciled_row`. ``specs/transitions.md`` (section
"Lost replies") states these rules and ``tests/core/test_spec_table.py`` checks them.

An audit row that changes no lease (a refusal's, a grant issue's) is a different case: it
can simply be sent again under its event id, which the store applies at most once, so
:func:`recorded` retries it once rather than report an unknown outcome.
"""

from __future__ import annotations

import logging
from datetime import datetime
from uuid import UUID

import attrs

from mos_lease.errors import CommitOutcomeUnknown, StoreUnavailable
from mos_lease.machine import (
    Acquire,
    Close,
    Command,
    Insert,
    Renew,
    Rotate,
    Takeover,
    Write,
    success_epoch,
)
from mos_lease.records import AuditEntry, LeaseRow
from mos_lease.store_ops import Flow, Record
from mos_lease.vocabulary import Outcome

log = logging.getLogger("mos_lease")


def took_effect(entry: AuditEntry) -> bool:
    """Whether the attempt ``entry`` records changed anything, which is what reconciling its
    event id asks: every outcome but ``denied`` is an attempt that took effect (a write
    applied, a grant issued). The PostgreSQL store asks the same of its log in
    ``event_committed.sql``."""
    return entry.outcome is not Outcome.DENIED


def is_own_write(command: Command, row: LeaseRow | None) -> bool:
    """Whether ``row``, read after a write of ``command`` was refused or lost, is in fact that
    write's work: it carries the new lease id our acquire or takeover made for it."""
    return (row is not None and isinstance(command, Acquire | Takeover)
            and row.lease_id == command.new_lease_id)


def written_lease_id(write: Write, row: LeaseRow) -> UUID:
    """The lease id ``write`` left on the row it applied to (``row``: the row as read)."""
    if isinstance(write, Rotate):
        return write.new_lease_id
    if isinstance(write, Insert | Renew | Close):
        return write.lease_id
    return row.lease_id


def reconciled_row(command: Command, write: Write, row: LeaseRow | None,
                   now: datetime) -> LeaseRow:
    """The row our committed ``write`` produced, as far as it can still be known from the
    ``row`` read afterwards at store time ``now``: that row itself if it still carries our
    lease id and epoch; else (superseded since) the write as it was made, with an expiry
    that is already over, so the caller holds nothing it could act on."""
    assert row is not None  # our write committed, and rows are never deleted
    lease_id = written_lease_id(write, row)
    epoch = success_epoch(command)
    if row.lease_id == lease_id and row.epoch == epoch:
        return row
    assert epoch is not None
    return attrs.evolve(row, lease_id=lease_id, epoch=epoch,
                        connector_id=command.connector_id, expires_at=now)


def recorded(entry: AuditEntry) -> Flow[None]:
    """Append ``entry``, an audit row that changes no lease (a refusal, a grant issue), and
    return only once it is known to be in the log.

    When its outcome is unknown (the reply of the append was lost) it is sent once more under
    the same event id: the store applies an event id at most once, and takes the resend of
    the same entry as done when the first attempt had committed. So the caller is told its
    refusal or its grant, not an unknown outcome. Once, not in a loop, so the call stays
    within its documented bound; if the resend fails too, the first attempt's
    ``CommitOutcomeUnknown`` is raised (it may have committed, so "nothing changed" would be
    false)."""
    try:
        yield Record(entry)
    except CommitOutcomeUnknown as unknown:
        log.warning("mos_lease: %s %s audit append outcome unknown, sending it again: %s",
                    entry.event, entry.event_id, unknown)
        try:
            yield Record(entry)
        except (CommitOutcomeUnknown, StoreUnavailable) as again:
            raise unknown from again
