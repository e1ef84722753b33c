"""How the operator commands print what they read: lease rows, a fleet and audit records as
JSON objects, and plain-text tables (``mos-lease status``, ``mos-lease status --fleet``,
``mos-lease audit``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from mos_lease.fleet.census import FleetCensus, MemberShare, UnheldBinding
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


def _member_state(member: MemberShare) -> str:
    if member.live:
        return "live"
    if member.rejected is not None:
        return f"refused: {member.rejected.value}"
    return member.state.value


def _for(since: datetime, now: datetime) -> float:
    return round(max((now - since).total_seconds(), 0.0), 3)


def fleet_text(found: FleetCensus) -> str:
    """``mos-lease status --fleet``: a summary line, the members and their shares, and the
    bindings no one holds, the oldest first."""
    lines = [f"fleet {found.fleet} at database time {found.now.isoformat()}: "
             f"{found.live} of {len(found.members)} member(s) live; {found.held} binding(s) "
             f"held, {found.unheld} without a holder"
             + (f" (the oldest for {_for(found.unheld_since, found.now):g} s)"
                if found.unheld_since is not None else "")]
    lines.append(table(
        ("MEMBER", "STATE", "ENDPOINT", "EPOCH", "EXPIRES", "HELD"),
        [(m.name, _member_state(m), m.endpoint or "-", str(m.epoch), m.expires_at.isoformat(),
          str(m.held)) for m in found.members]))
    if found.oldest:
        lines.append(f"without a holder, the oldest {len(found.oldest)} of {found.unheld}:")
        lines.append(table(
            ("TENANT", "AGENT", "BINDING", "LAST MEMBER", "EPOCH", "STATE", "SINCE", "FOR"),
            [(b.identity.tenant_id, b.identity.logical_agent_id, b.identity.binding_id,
              b.member, str(b.epoch), b.state.value, b.since.isoformat(),
              f"{_for(b.since, found.now):g} s") for b in found.oldest]))
    return "\n".join(lines)


def _unheld_json(binding: UnheldBinding, now: datetime) -> dict[str, Any]:
    return {"tenant_id": binding.identity.tenant_id,
            "logical_agent_id": binding.identity.logical_agent_id,
            "binding_id": binding.identity.binding_id, "member": binding.member,
            "epoch": binding.epoch, "state": binding.state.value,
            "since": iso(binding.since), "for_seconds": _for(binding.since, now)}


def fleet_json(found: FleetCensus) -> dict[str, Any]:
    """``mos-lease status --fleet --json``: the same as one JSON object."""
    return {
        "fleet": found.fleet, "now": iso(found.now),
        "members": [{"member": m.name, "connector_id": m.connector_id,
                     "endpoint": m.endpoint, "epoch": m.epoch, "state": m.state.value,
                     "live": m.live,
                     "rejected": None if m.rejected is None else m.rejected.value,
                     "expires_at": iso(m.expires_at), "held": m.held}
                    for m in found.members],
        "held": found.held,
        "unheld": {"count": found.unheld, "oldest_since": iso(found.unheld_since),
                   "oldest_for_seconds": (None if found.unheld_since is None
                                          else _for(found.unheld_since, found.now)),
                   "oldest": [_unheld_json(b, found.now) for b in found.oldest]},
    }
