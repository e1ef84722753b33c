"""The SQL the store sends (how the rows that come back map to records: :mod:`.rows`).

This module is the single source of truth for both stores: :class:`Call` describes one
statement (its text, parameters, how to read its result and what a lost connection during it
means), and the sync and async stores only send calls. The SQL itself lives in
``sql/statements/*.sql`` inside the package.

Every lease write is the envelope ``guarded_write.sql`` around one of ``insert.sql``,
``renew.sql``, ``close.sql`` or ``rotate.sql``: a single data-modifying statement that reads
the database clock, applies the write if its guard holds and appends the audit row from the
write's ``RETURNING``. Those guards are :func:`mos_lease.machine.guard_holds` written in SQL.
A takeover or a release also sends a ``NOTIFY`` on :func:`notice_channel` (``notify.sql``) in
the same statement: a hint for :mod:`mos_lease_pg.notices`, never part of fencing.

Every statement names its schema; nothing depends on the session's ``search_path`` (a role
whose search_path finds another copy of the tables, or none, must neither write to that copy
nor fail obscurely). The files write ``{schema}.table`` and :meth:`Template.at` substitutes
the quoted schema of the store (``ConnectionSettings.schema``). Loading refuses a statement
that names a library table without ``{schema}.`` (see :func:`unqualified`), at import time.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Final, Generic, TypeVar
from uuid import UUID

import attrs

from mos_lease.errors import InvalidInput
from mos_lease.fleet.members import FLEET_TENANT
from mos_lease.identity import LeaseIdentity
from mos_lease.machine import Close, Insert, Renew, Rotate, Write
from mos_lease.metadata import Metadata
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg.rows import (
    Row,
    parse_audit_records,
    parse_flag,
    parse_lease_rows,
    parse_nothing,
    parse_renewals,
    parse_snapshot,
    parse_time,
    parse_timed_lease_rows,
    parse_write_outcome,
)
from mos_lease_pg.sql_files import (
    DEFAULT_SCHEMA,
    Statement,
    Template,
    check_schema,
    statement_text,
)

T = TypeVar("T")


def _statement(name: str) -> Template:
    return Template(name, statement_text(name))


def _pieced(text: str, pieces: Mapping[str, str]) -> str:
    for mark, piece in pieces.items():
        if mark not in text:
            raise AssertionError(f"statement has no {mark}")
        text = text.replace(mark, piece.rstrip())
    return text


# The columns each shared guard matches, each written in its file as ``{column}``.
_GUARDS: Final[Mapping[str, tuple[str, ...]]] = {
    "active_holder": ("tenant_id", "logical_agent_id", "binding_id", "connector_id",
                      "lease_id", "epoch"),
    "takeover_guard": ("tenant_id", "logical_agent_id", "binding_id", "expected_epoch",
                       "preempt_active"),
}


def _with_guards(text: str, value: Callable[[str], str]) -> str:
    # A single write and its batch share their guard, kept once in active_holder.sql
    # (heartbeat, release) or takeover_guard.sql (takeover); ``value`` names what each key
    # column must equal: a parameter, or a request row's column.
    for name, columns in _GUARDS.items():
        if f"{{{name}}}" in text:
            guard = _pieced(statement_text(f"{name}.sql"),
                            {f"{{{column}}}": value(column) for column in columns})
            text = _pieced(text, {f"    {{{name}}}": guard})
    return text


def _guarded(name: str, lock: str = "lock_row.sql", *, notify: bool = False,
             audit: bool = True) -> Template:
    # ``lock`` is the step that takes the row lock before the clock is read; ``notify``: the
    # write sends a push notice; ``audit``: it appends its audit row (see guarded_write.sql).
    write = _with_guards(statement_text(name), lambda column: f"%({column})s")
    return Template(name, _pieced(statement_text("guarded_write.sql"), {
        "{lock}": statement_text(lock), "{write}": write,
        "{audit}": statement_text("audit_write.sql" if audit else "audit_none.sql"),
        "{notify}": statement_text("notify.sql" if notify else "notify_none.sql")}))


def _renew_many(*, audit: bool) -> Template:
    text = _with_guards(statement_text("renew_many.sql"), lambda column: f"r.{column}")
    return Template("renew_many.sql", _pieced(text, {
        "{audit}": statement_text("audit_renewals.sql" if audit else "audit_none.sql")}))


NOTICE_CHANNEL_PREFIX: Final = "mos_lease_"
# PostgreSQL refuses a channel name of NAMEDATALEN (64) bytes or more.
_MAX_CHANNEL: Final = 63
# The writes that change who may hold a lease send a notice, with this kind in its payload.
# Acquire and heartbeat do not: nobody waits for them.
NOTICE_KINDS: Final[Mapping[type[Write], str]] = {Close: "release", Rotate: "takeover"}


def notice_channel(schema: str = DEFAULT_SCHEMA) -> str:
    """The ``LISTEN`` channel of the lease notices of ``schema``: ``mos_lease_<schema>``, or,
    for a schema name too long for that, ``mos_lease_`` and a digest of it (one channel per
    schema either way, so stores on different schemas never hear each other)."""
    channel = NOTICE_CHANNEL_PREFIX + check_schema(schema)
    if len(channel) <= _MAX_CHANNEL:
        return channel
    digest = hashlib.sha256(schema.encode("ascii")).hexdigest()
    return NOTICE_CHANNEL_PREFIX + digest[:_MAX_CHANNEL - len(NOTICE_CHANNEL_PREFIX)]


LOAD: Final = _statement("load.sql")
LOAD_MANY: Final = _statement("load_many.sql")
RECORD: Final = _statement("record.sql")
RECORD_MANY: Final = _statement("record_many.sql")
EVENT_COMMITTED: Final = _statement("event_committed.sql")
END_LOST_BACKEND: Final = _statement("end_lost_backend.sql")
NOW: Final = _statement("now.sql")
LEASES: Final = _statement("leases.sql")
FLEET_LEASES: Final = _statement("fleet_leases.sql")
AUDIT: Final = _statement("audit.sql")
RENEW_MANY: Final = _renew_many(audit=True)
WRITES: Final[Mapping[type[Write], Template]] = {
    Insert: _guarded("insert.sql", lock="lock_none.sql"),
    Renew: _guarded("renew.sql"),
    Close: _guarded("close.sql", notify=True),
    Rotate: _guarded("rotate.sql", notify=True),
}
# A store with ``ConnectionSettings(audit_heartbeats=False)`` renews without the audit row.
QUIET_RENEW: Final = _guarded("renew.sql", audit=False)
QUIET_RENEW_MANY: Final = _renew_many(audit=False)


class Kind(enum.Enum):
    """What a lost connection during a call means, and whether the call may be resent."""

    READ = "read"  # changes nothing: resend once on a fresh connection
    IDEMPOTENT_WRITE = "idempotent write"  # keyed by its event id: resending is safe
    WRITE = "write"  # may have committed: the outcome is unknown and must be reconciled


@attrs.define(slots=True)
class Call(Generic[T]):
    """One statement to send, and how to turn its rows into the store's answer.

    Built for every statement the store sends and read once: a plain slotted class, not a
    frozen one (a frozen attrs instance costs about twice as much to build, every field
    set through ``object.__setattr__``); nothing changes or hashes a call."""

    what: str  # for error messages: "load", "takeover write", ...
    statement: Statement
    params: Mapping[str, object]
    parse: Callable[[Sequence[Row]], T]
    kind: Kind = Kind.READ
    # For writes: the audit event that exists exactly when the write committed.
    event_id: UUID | None = None
    identity: LeaseIdentity | None = None
    # False for a heartbeat sent without its audit row: its event cannot be looked up.
    audited: bool = True



# --- calls --------------------------------------------------------------------------------


def _identity_params(identity: LeaseIdentity) -> dict[str, object]:
    return {"tenant_id": identity.tenant_id, "logical_agent_id": identity.logical_agent_id,
            "binding_id": identity.binding_id}


def _entry_params(entry: AuditEntry) -> dict[str, object]:
    return {
        "event_id": entry.event_id, "event": entry.event.value, "outcome": entry.outcome.value,
        "reason": None if entry.reason is None else entry.reason.value,
        "entry_tenant_id": entry.identity.tenant_id,
        "entry_logical_agent_id": entry.identity.logical_agent_id,
        "entry_binding_id": entry.identity.binding_id,
        "entry_connector_id": entry.connector_id, "entry_epoch": entry.epoch,
        "correlation_id": entry.correlation_id,
    }


def load(identity: LeaseIdentity, offset: timedelta, *,
         schema: str = DEFAULT_SCHEMA) -> Call[Snapshot]:
    # Spelled out rather than merged from _identity_params: every validation sends this.
    params = {"offset": offset, "tenant_id": identity.tenant_id,
              "logical_agent_id": identity.logical_agent_id, "binding_id": identity.binding_id}
    return Call("load", LOAD.at(schema), params, functools.partial(parse_snapshot, identity))


def _metadata_json(metadata: Metadata) -> str:
    # Sent as JSON text and cast in the statement (``%(metadata)s::jsonb``); the checks of
    # mos_lease.metadata already bounded it, so the text is at most a few KiB.
    return json.dumps(dict(metadata), ensure_ascii=False, separators=(",", ":"))


def _snapshots(identities: Sequence[LeaseIdentity], rows: Sequence[Row]) -> list[Snapshot]:
    if len(rows) != len(identities):
        raise AssertionError(f"expected {len(identities)} rows, got {len(rows)}")
    # Rows come in the order of the keys (ORDER BY their position): each is its load's row.
    return [parse_snapshot(identity, (row[1:],)) for identity, row in zip(identities, rows,
                                                                         strict=True)]


def load_many(identities: Sequence[LeaseIdentity], offset: timedelta, *,
              schema: str = DEFAULT_SCHEMA) -> Call[list[Snapshot]]:
    """One statement reading the rows of ``identities`` (duplicates allowed), each as
    :func:`load` reads it, all at one database time (``load_many.sql``)."""
    keys = list(identities)
    params = {"offset": offset, "tenant_ids": [i.tenant_id for i in keys],
              "logical_agent_ids": [i.logical_agent_id for i in keys],
              "binding_ids": [i.binding_id for i in keys]}
    # "load", as a single read says: a failure reads the same to each caller it serves.
    return Call("load", LOAD_MANY.at(schema), params, functools.partial(_snapshots, keys))


def _write_params(write: Write) -> dict[str, object]:
    if isinstance(write, Insert):
        return {"lease_id": write.lease_id, "connector_id": write.connector_id,
                "scopes": list(write.scopes), "ttl": write.ttl,
                "metadata": _metadata_json(write.metadata)}
    if isinstance(write, Renew):
        return {"connector_id": write.connector_id, "lease_id": write.lease_id,
                "epoch": write.epoch, "ttl": write.ttl}
    if isinstance(write, Close):
        return {"connector_id": write.connector_id, "lease_id": write.lease_id,
                "epoch": write.epoch}
    return {"expected_epoch": write.expected_epoch, "preempt_active": write.preempt_active,
            "new_lease_id": write.new_lease_id, "connector_id": write.connector_id,
            "scopes": list(write.scopes), "ttl": write.ttl,
            "metadata": _metadata_json(write.metadata)}


def apply(write: Write, entry: AuditEntry, offset: timedelta, *,
          schema: str = DEFAULT_SCHEMA, audit_heartbeats: bool = True) -> Call[WriteOutcome]:
    params = {"offset": offset, **_identity_params(write.identity), **_write_params(write),
              **_entry_params(entry)}
    notice = NOTICE_KINDS.get(type(write))
    if notice is not None:
        params |= {"channel": notice_channel(schema), "notice": notice}
    audited = audit_heartbeats or not isinstance(write, Renew)
    template = WRITES[type(write)] if audited else QUIET_RENEW
    return Call(f"{entry.event} write", template.at(schema), params,
                functools.partial(parse_write_outcome, write.identity,
                                  finds_row=not isinstance(write, Insert)), Kind.WRITE,
                event_id=entry.event_id, identity=write.identity, audited=audited)



def renew_many(renewals: Sequence[tuple[Renew, AuditEntry]], offset: timedelta, *,
               schema: str = DEFAULT_SCHEMA,
               audit_heartbeats: bool = True) -> Call[list[WriteOutcome]]:
    """One statement renewing every lease of a batch of heartbeats (``renew_many.sql``)."""
    for write, entry in renewals:
        if (type(write) is not Renew or entry.event is not LifecycleEvent.HEARTBEAT
                or entry.outcome is not Outcome.RENEWED or entry.reason is not None
                or entry.identity != write.identity or entry.connector_id != write.connector_id
                or entry.epoch != write.epoch):
            raise InvalidInput("renewals", "each must be a Renew with the renewed heartbeat "
                               "audit entry of the same identity, connector and epoch")
    items = renewals
    renews = [write for write, _ in items if isinstance(write, Renew)]
    params = {
        "offset": offset,
        "tenant_ids": [w.identity.tenant_id for w in renews],
        "logical_agent_ids": [w.identity.logical_agent_id for w in renews],
        "binding_ids": [w.identity.binding_id for w in renews],
        "connector_ids": [w.connector_id for w in renews],
        "lease_ids": [w.lease_id for w in renews],
        "epochs": [w.epoch for w in renews],
        "ttls": [w.ttl for w in renews],
        "event_ids": [entry.event_id for _, entry in items],
        "correlation_ids": [entry.correlation_id for _, entry in items],
    }
    first_write, first_entry = items[0]
    template = RENEW_MANY if audit_heartbeats else QUIET_RENEW_MANY
    return Call(f"batch of {len(items)} heartbeats", template.at(schema), params,
                functools.partial(parse_renewals, [(w.identity, w.lease_id) for w in renews]),
                Kind.WRITE,
                event_id=first_entry.event_id, identity=first_write.identity,
                audited=audit_heartbeats)


def record(entry: AuditEntry, offset: timedelta, *,
           schema: str = DEFAULT_SCHEMA) -> Call[None]:
    return Call("audit record", RECORD.at(schema), {"offset": offset, **_entry_params(entry)},
                parse_nothing, Kind.IDEMPOTENT_WRITE, entry.event_id, entry.identity)


def _counts(rows: Sequence[Row]) -> list[int]:
    return [int(row[0]) for row in rows]


def record_many(entries: Sequence[AuditEntry], offset: timedelta, *,
                schema: str = DEFAULT_SCHEMA) -> Call[list[int]]:
    """One statement appending every entry as :func:`record` appends it, in order, in one
    transaction (``record_many.sql``): how many rows each inserted (0: its event id was
    taken)."""
    if not entries:
        raise AssertionError("record_many needs at least one entry")
    params = {
        "offset": offset,
        "event_ids": [e.event_id for e in entries],
        "events": [e.event.value for e in entries],
        "outcomes": [e.outcome.value for e in entries],
        "reasons": [None if e.reason is None else e.reason.value for e in entries],
        "tenant_ids": [e.identity.tenant_id for e in entries],
        "logical_agent_ids": [e.identity.logical_agent_id for e in entries],
        "binding_ids": [e.identity.binding_id for e in entries],
        "connector_ids": [e.connector_id for e in entries],
        "epochs": [e.epoch for e in entries],
        "correlation_ids": [e.correlation_id for e in entries],
    }
    first = entries[0]

    def parse(rows: Sequence[Row]) -> list[int]:
        counts = _counts(rows)
        if len(counts) != len(entries):
            raise AssertionError(f"expected {len(entries)} rows, got {len(counts)}")
        return counts

    return Call(f"batch of {len(entries)} audit records", RECORD_MANY.at(schema), params,
                parse, Kind.IDEMPOTENT_WRITE, first.event_id, first.identity)


def event_committed(event_id: UUID, *, schema: str = DEFAULT_SCHEMA) -> Call[bool]:
    return Call("event lookup", EVENT_COMMITTED.at(schema), {"event_id": event_id}, parse_flag)


def now(offset: timedelta, *, schema: str = DEFAULT_SCHEMA) -> Call[datetime]:
    return Call("clock read", NOW.at(schema), {"offset": offset}, parse_time)


def leases(tenant_id: str | None, *, schema: str = DEFAULT_SCHEMA) -> Call[list[LeaseRow]]:
    return Call("lease listing", LEASES.at(schema), {"tenant_id": tenant_id}, parse_lease_rows)


def fleet_leases(fleet: str, tenant_id: str | None, offset: timedelta, *,
                 schema: str = DEFAULT_SCHEMA) -> Call[tuple[datetime, list[LeaseRow]]]:
    params = {"fleet": fleet, "fleet_tenant": FLEET_TENANT, "tenant_id": tenant_id,
              "offset": offset}
    return Call("fleet listing", FLEET_LEASES.at(schema), params, parse_timed_lease_rows)


def audit(*, tenant_id: str | None, logical_agent_id: str | None, binding_id: str | None,
          after_seq: int, limit: int, schema: str = DEFAULT_SCHEMA) -> Call[list[AuditRecord]]:
    params = {"tenant_id": tenant_id, "logical_agent_id": logical_agent_id,
              "binding_id": binding_id, "after_seq": after_seq, "limit": limit}
    return Call("audit listing", AUDIT.at(schema), params, parse_audit_records)
