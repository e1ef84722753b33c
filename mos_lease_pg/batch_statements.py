"""The statements of the batched acquire, takeover and release (``acquire_many.sql``,
``takeover_many.sql``, ``release_many.sql``): how a batch of writes of one kind is sent as
one statement, apart from :mod:`mos_lease_pg.statements` (the single writes and the reads),
whose pieces it shares: the guards, the metadata encoding, the notice channel."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Final

from mos_lease.errors import InvalidInput
from mos_lease.identity import LeaseIdentity
from mos_lease.machine import Close, Insert, Rotate, Write, written_epoch
from mos_lease.records import AuditEntry, WriteOutcome
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg.rows import parse_batch_writes
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, Template, statement_text
from mos_lease_pg.statements import (
    NOTICE_KINDS,
    Call,
    Kind,
    _metadata_json,
    _pieced,
    _with_guards,
    notice_channel,
)


def _write_many(name: str, *, notify: bool) -> Template:
    # A batched acquire, takeover or release (acquire_many.sql, takeover_many.sql,
    # release_many.sql): its guard, its audit rows and (for the two that lock) its lock step,
    # notices and final SELECT, each kept once in its own file.
    text = _with_guards(statement_text(name), lambda column: f"r.{column}")
    pieces = {"{audit_many}": statement_text("audit_many.sql")}
    if notify:
        # applied_many.sql first: it holds the marks of the three pieces after it.
        pieces = {"{applied_many}": statement_text("applied_many.sql"), **pieces,
                  "{lock_many}": statement_text("lock_many.sql"),
                  "{notify_many}": statement_text("notify_many.sql"),
                  "{found_many}": statement_text("found_many.sql")}
    return Template(name, _pieced(text, pieces))


ACQUIRE_MANY: Final = _write_many("acquire_many.sql", notify=False)
TAKEOVER_MANY: Final = _write_many("takeover_many.sql", notify=True)
RELEASE_MANY: Final = _write_many("release_many.sql", notify=True)


# What each batched write is sent as: its statement, its kind of write, and the audit event
# and outcome every entry of it must carry (audit_many.sql writes them from the row).
_BATCHES: Final[Mapping[type[Write], tuple[Template, str, LifecycleEvent, Outcome]]] = {
    Insert: (ACQUIRE_MANY, "acquires", LifecycleEvent.ACQUIRE, Outcome.ACQUIRED),
    Rotate: (TAKEOVER_MANY, "takeovers", LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER),
    Close: (RELEASE_MANY, "releases", LifecycleEvent.RELEASE, Outcome.RELEASED),
}


def _batch_params(writes: Sequence[Write]) -> dict[str, object]:
    """The request arrays of a batch of one kind: one element per write, each a column of
    the statement's ``req``."""
    params: dict[str, object] = {
        "tenant_ids": [w.identity.tenant_id for w in writes],
        "logical_agent_ids": [w.identity.logical_agent_id for w in writes],
        "binding_ids": [w.identity.binding_id for w in writes],
        "connector_ids": [w.connector_id for w in writes],
    }
    made = [w for w in writes if isinstance(w, Insert | Rotate)]
    if made:
        params |= {"scopes": [json.dumps(list(w.scopes)) for w in made],
                   "ttls": [w.ttl for w in made],
                   "metadata": [_metadata_json(w.metadata) for w in made]}
    inserts = [w for w in writes if isinstance(w, Insert)]
    rotations = [w for w in writes if isinstance(w, Rotate)]
    closes = [w for w in writes if isinstance(w, Close)]
    if inserts:
        params["lease_ids"] = [w.lease_id for w in inserts]
    if rotations:
        params |= {"expected_epochs": [w.expected_epoch for w in rotations],
                   "preempt_actives": [w.preempt_active for w in rotations],
                   "new_lease_ids": [w.new_lease_id for w in rotations]}
    if closes:
        params |= {"lease_ids": [w.lease_id for w in closes],
                   "epochs": [w.epoch for w in closes]}
    return params


def write_many(items: Sequence[tuple[Write, AuditEntry]], offset: timedelta, *,
               schema: str = DEFAULT_SCHEMA) -> Call[list[WriteOutcome]]:
    """One statement applying a batch of acquires, takeovers or releases (all of one kind,
    distinct identities): ``acquire_many.sql``, ``takeover_many.sql``, ``release_many.sql``.
    A batch that breaks those rules, or whose audit entries do not describe its writes,
    raises :class:`InvalidInput` and sends nothing."""
    kind = type(items[0][0])
    if kind not in _BATCHES:
        raise InvalidInput("writes", f"no batch of {kind.__name__} writes")
    template, what, event, outcome = _BATCHES[kind]
    seen: set[LeaseIdentity] = set()
    for write, entry in items:
        if (type(write) is not kind or entry.event is not event
                or entry.outcome is not outcome or entry.reason is not None
                or entry.identity != write.identity or entry.connector_id != write.connector_id
                or entry.epoch != written_epoch(write)):
            raise InvalidInput("writes", f"each must be a {kind.__name__} with the "
                               f"{outcome.value} {event.value} audit entry of the same "
                               "identity, connector and epoch")
        if write.identity in seen:
            raise InvalidInput("writes", f"{write.identity} appears twice in one batch")
        seen.add(write.identity)
    writes = [write for write, _ in items]
    params = {"offset": offset, **_batch_params(writes),
              "event_ids": [entry.event_id for _, entry in items],
              "correlation_ids": [entry.correlation_id for _, entry in items],
              "event": event.value, "outcome": outcome.value}
    notice = NOTICE_KINDS.get(kind)
    if notice is not None:
        params |= {"channel": notice_channel(schema), "notice": notice}
    first_write, first_entry = items[0]
    return Call(f"batch of {len(items)} {what}", template.at(schema), params,
                functools.partial(parse_batch_writes, [w.identity for w in writes],
                                  finds_row=kind is not Insert),
                Kind.WRITE, event_id=first_entry.event_id, identity=first_write.identity)
