"""A write whose reply was lost: the rules that tell what it did (pure: no I/O, no clock).

A connection can drop after the commit was sent, so a write may have taken effect without
its caller learning so. Two facts settle it without a blind retry (which, for a takeover,
would fail against our own new epoch, or be taken for someone else's):

* the write's audit row exists exactly when the write committed (the store answers
  ``event_committed``), and
* every lease id is made before the write that installs it and never reused, so a row
  carrying the new lease id of our acquire or takeover names us as its writer
  (:func:`is_own_write`).

What the caller is then told is :func:`reconciled_row`. ``specs/transitions.md`` (section
"Lost replies") states both rules and ``tests/core/test_spec_table.py`` checks them.
"""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

import attrs

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
from mos_lease.records import LeaseRow


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
