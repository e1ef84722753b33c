"""How the operator commands print what they read: lease rows and audit records as JSON
objects, and plain-text tables (``mos-lease status``, ``mos-lease audit``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from mos_lease.records import AuditRecord, LeaseRow


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def lease_json(row: LeaseRow, now: datetime) -> dict[str, Any]:
    return {
        "tenant_id": row.identity.tenant_id, "logical_agent_id": row.identity.logical_agent_id,
        "binding_id": row.identity.binding_id, "connector_id": row.connector_id,
        "epoch": row.epoch, "state": row.state(now).value, "scopes": list(row.scopes),
        "acquired_at": iso(row.acquired_at), "heartbeat_at": iso(row.heartbeat_at),
        "expires_at": iso(row.expires_at), "released_at": iso(row.released_at),
        "updated_at": iso(row.updated_at), "metadata": dict(row.metadata),
        "metadata_invalid": row.metadata_invalid,
    }


METADATA_WITHHELD: Final = "<invalid: withheld>"
"""What ``mos-lease status`` shows for metadata the store withheld (``metadata_invalid``):
never the stored text, which may hold a terminal's escape sequences."""


def metadata_text(row: LeaseRow) -> str:
    if row.metadata_invalid:
        return METADATA_WITHHELD
    # Compact JSON: values may hold spaces, commas or "=", and this reads back unambiguously.
    # Checked metadata holds printable characters only, so none reaches the terminal raw.
    if not row.metadata:
        return "-"
    return json.dumps(dict(row.metadata), ensure_ascii=False, separators=(",", ":"))


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                     .rstrip() for line in (header, *rows))


def audit_json(record: AuditRecord) -> dict[str, Any]:
    entry = record.entry
    return {
        "seq": record.seq, "recorded_at": iso(record.recorded_at),
        "event_id": str(entry.event_id), "event": entry.event.value,
        "outcome": entry.outcome.value,
        "reason": None if entry.reason is None else entry.reason.value,
        "tenant_id": entry.identity.tenant_id,
        "logical_agent_id": entry.identity.logical_agent_id,
        "binding_id": entry.identity.binding_id, "connector_id": entry.connector_id,
        "epoch": entry.epoch, "correlation_id": entry.correlation_id,
    }
