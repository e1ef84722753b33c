"""The rows the store's statements return, mapped to the core's records: a lease row to
:class:`~mos_lease.records.LeaseRow`, an audit row to :class:`~mos_lease.records.AuditRecord`,
and the ``parse_*`` functions each :class:`~mos_lease_pg.statements.Call` reads its result
with. Apart from :mod:`mos_lease_pg.statements`, which says what is sent, because this is
what comes back; both stores use it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final
from uuid import UUID

from mos_lease.identity import LeaseIdentity
from mos_lease.metadata import EMPTY_METADATA, stored_metadata
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason

Row = tuple[Any, ...]


def _utc(value: datetime) -> datetime:
    # The session time zone decides how timestamptz arrives; the core works in UTC. A UTC
    # session (the default settings) delivers them in UTC already: no conversion then.
    return value if value.tzinfo is UTC else value.astimezone(UTC)


def _maybe_utc(value: datetime | None) -> datetime | None:
    return None if value is None else _utc(value)


LEASE_COLUMNS: Final = 10
"""How many columns :func:`lease_row` maps (a statement returns them in its order)."""


def lease_row(identity: LeaseIdentity, cols: Sequence[Any],
              known_id: UUID | None = None) -> LeaseRow:
    """Map (lease_id, connector_id, allowed_scopes, epoch, acquired_at, heartbeat_at,
    expires_at, released_at, updated_at, holder_metadata) to a :class:`LeaseRow`. A lease id
    equal to ``known_id`` (the one a renewal sent) is that object, not a new one: a
    supervisor keeps the handles of thousands of leases, renewed every tick, and a copy of
    each id per tick is work for the garbage collector."""
    (lease_id, connector_id, scopes, epoch, acquired, heartbeat, expires, released, updated,
     metadata) = cols
    # Judged as a write is judged (mos_lease.metadata): the database bounds the column only
    # from migration 0010 on, and a row written before, or around the library, may hold what
    # no write of the library could. psycopg reads jsonb as a dict; the statements send NULL
    # for an empty object (no JSON to parse on the hot paths), which is the shared empty.
    shown = stored_metadata(metadata, identity, epoch)
    if lease_id == known_id:
        lease_id = known_id
    if updated.tzinfo is not UTC:
        # One session's time zone delivered every column of the row: a UTC session (the
        # default settings) needs no conversion, so it is asked once, not per column.
        acquired, heartbeat, expires, updated = (
            _utc(acquired), _utc(heartbeat), _utc(expires), _utc(updated))
        released = _maybe_utc(released)
    return LeaseRow(
        identity=identity, lease_id=lease_id, connector_id=connector_id,
        scopes=tuple(scopes), epoch=epoch, acquired_at=acquired, heartbeat_at=heartbeat,
        expires_at=expires, released_at=released, updated_at=updated,
        metadata=EMPTY_METADATA if shown is None else shown, metadata_invalid=shown is None,
    )


def _single(rows: Sequence[Row]) -> Row:
    if len(rows) != 1:
        raise AssertionError(f"expected exactly one row, got {len(rows)}")
    return rows[0]


def parse_snapshot(identity: LeaseIdentity, rows: Sequence[Row]) -> Snapshot:
    """A read's one row: the database time, then the lease columns (all NULL for no row:
    ``lease_id`` is NOT NULL in the table, so a NULL means the LEFT JOIN found none)."""
    found = _single(rows)
    row = None if found[1] is None else lease_row(identity, found[1:])
    return Snapshot(row, _utc(found[0]))


def parse_write_outcome(identity: LeaseIdentity, rows: Sequence[Row], *,
                   finds_row: bool = False, known_id: UUID | None = None) -> WriteOutcome:
    """A guarded write's row: the time, its new lease columns, and (``finds_row``: for the
    writes that lock an existing row) the row it found, which names a refusal. ``known_id``
    is the lease id the write sent (:func:`lease_row`)."""
    now, *cols = _single(rows)
    written = cols[:LEASE_COLUMNS]
    if written[0] is not None:  # lease_id is NOT NULL: a NULL means the guard did not hold
        return WriteOutcome(lease_row(identity, written, known_id), _utc(now))
    found = cols[LEASE_COLUMNS:2 * LEASE_COLUMNS]
    if not finds_row or len(found) != LEASE_COLUMNS:
        return WriteOutcome(None, _utc(now))
    row = None if found[0] is None else lease_row(identity, found)
    return WriteOutcome(None, _utc(now), found=Snapshot(row, _utc(now)))


def parse_nothing(rows: Sequence[Row]) -> None:
    return None


def parse_flag(rows: Sequence[Row]) -> bool:
    return bool(_single(rows)[0])


def parse_time(rows: Sequence[Row]) -> datetime:
    return _utc(_single(rows)[0])


def parse_lease_rows(rows: Sequence[Row]) -> list[LeaseRow]:
    return [lease_row(LeaseIdentity(*row[:3]), row[3:]) for row in rows]


def parse_timed_lease_rows(rows: Sequence[Row]) -> tuple[datetime, list[LeaseRow]]:
    """The database time every row carries first, and the lease rows after it (none when
    the one row that came back has no lease: its columns are NULL)."""
    return _utc(rows[0][0]), parse_lease_rows([row[1:] for row in rows if row[1] is not None])


def audit_record(row: Row) -> AuditRecord:
    """Map one ``audit.sql`` row to an :class:`AuditRecord`."""
    (seq, event_id, event, outcome, reason, tenant_id, agent_id, binding_id, connector_id,
     epoch, correlation_id, recorded_at) = row
    entry = AuditEntry(
        event_id=event_id, event=LifecycleEvent(event), outcome=Outcome(outcome),
        reason=None if reason is None else Reason(reason),
        identity=LeaseIdentity(tenant_id, agent_id, binding_id), connector_id=connector_id,
        epoch=epoch, correlation_id=correlation_id,
    )
    return AuditRecord(seq, entry, _utc(recorded_at))


def parse_audit_records(rows: Sequence[Row]) -> list[AuditRecord]:
    return [audit_record(row) for row in rows]


def parse_renewals(renewed: Sequence[tuple[LeaseIdentity, UUID]],
                   rows: Sequence[Row]) -> list[WriteOutcome]:
    """A batched heartbeat's rows (``renew_many.sql``), one per ``(identity, lease_id)``
    renewed, in order: the time, the lease columns if that lease was renewed, and whether
    its row was skipped because another transaction held it locked (``reached=False``)."""
    if len(rows) != len(renewed):
        raise AssertionError(f"expected {len(renewed)} rows, got {len(rows)}")
    return [parse_write_outcome(identity, (row,), known_id=lease_id) if not row[-1]
            else WriteOutcome(None, _utc(row[0]), reached=False)
            for (identity, lease_id), row in zip(renewed, rows, strict=True)]


def parse_batch_writes(identities: Sequence[LeaseIdentity], rows: Sequence[Row], *,
                       finds_row: bool) -> list[WriteOutcome]:
    """A batched acquire's, takeover's or release's rows (``acquire_many.sql``,
    ``takeover_many.sql``, ``release_many.sql``), one per identity, in order: each read as
    :func:`parse_write_outcome` reads a single write's row. A takeover's or release's row
    also says whether it was skipped, held by another transaction (``reached=False``)."""
    if len(rows) != len(identities):
        raise AssertionError(f"expected {len(identities)} rows, got {len(rows)}")
    width = 1 + 2 * LEASE_COLUMNS
    return [WriteOutcome(None, _utc(row[0]), reached=False) if finds_row and row[width]
            else parse_write_outcome(identity, (row[:width],), finds_row=finds_row)
            for identity, row in zip(identities, rows, strict=True)]
