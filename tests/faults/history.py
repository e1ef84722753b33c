"""Recorded histories of fault scenarios, and the checker that judges them.

A scenario records every operation its processes perform as an :class:`OpRecord`: which
process, which lifecycle operation on which identity, with which arguments, what came back,
and the database clock (``clock_timestamp()``) read just before the call started and just
after it returned. After the run the checker compares those records with the audit log read
straight from PostgreSQL (with this module's own SQL, not the store's, so a store bug cannot
hide itself) and with the final lease rows.

The checker is deliberately independent of :mod:`mos_lease`: it knows the protocol only as
the guarantees state it, so it can catch the library disagreeing with itself. Its checks:

* at most one lease valid per identity at any instant: once a newer lease has been observed
  valid, no older one may be observed valid again (observations are intervals of database
  time; a lease's validity is one contiguous stretch, so a lower-epoch lease accepted after a
  higher-epoch lease was accepted means both were valid at the earlier instant);
* no operation of an epoch succeeded after a newer takeover had committed (the takeover's
  end, read from the database clock after it returned, is a point after its commit);
* nothing of a lease was accepted after its last known expiry or after its release, and no
  grant was accepted after its own expiry;
* epochs in the audit log start at 1, rise by exactly one per takeover and never repeat, and
  heartbeats, releases and grant issues are audited only at the current epoch;
* each epoch has exactly one winner (one lease id in the history, one success row in the
  audit log);
* no operation that committed after another session observed the lease expired renews (or
  releases) that lease: in the audit log, a ``renewed``/``released`` row of epoch E after (by
  ``seq``) a ``lease_expired`` refusal of epoch E. The refusal's read came before its audit
  append, and a guarded write's audit row is appended holding the row lock, so the write ran
  after the lease was seen expired (identity ``seq`` values are drawn in time order). Only
  ``lease_expired`` refusals count: they name the epoch they saw; an acquire's
  ``takeover_required`` does not, and a takeover committing between its read and its append
  would make any attribution unsound;
* every committed change has exactly one audit row and nothing else has one: audit rows are
  matched to operations through their correlation id, an operation whose outcome is unknown
  (a killed process, ``CommitOutcomeUnknown``) may have at most one, an operation refused
  with ``StoreUnavailable`` ("nothing changed") has none.

Only sound conclusions are drawn: two intervals that overlap never prove a violation.
"""

from __future__ import annotations

import enum
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

Ident = tuple[str, str, str]
"""(tenant_id, logical_agent_id, binding_id)."""


class Op(enum.StrEnum):
    ACQUIRE = "acquire"
    TAKEOVER = "takeover"
    HEARTBEAT = "heartbeat"
    RELEASE = "release"
    ISSUE_GRANT = "grant_issue"
    VALIDATE = "grant_validate"


class Status(enum.StrEnum):
    OK = "ok"  # the library reported success
    DENIED = "denied"  # a typed refusal (a result with a reason)
    ERROR = "error"  # StoreUnavailable: the library says nothing changed
    UNKNOWN = "unknown"  # CommitOutcomeUnknown, or the process died during the call


# The audit outcome of each operation's success, as the seed's vocabulary names it.
SUCCESS_OUTCOME: Mapping[Op, str] = {
    Op.ACQUIRE: "acquired",
    Op.TAKEOVER: "taken_over",
    Op.HEARTBEAT: "renewed",
    Op.RELEASE: "released",
    Op.ISSUE_GRANT: "grant_issued",
    Op.VALIDATE: "validated",
}
DENIED = "denied"
# Operations after which the lease they name is known to be valid at some instant of the
# call (a release too: it only succeeds on an active lease).
_WITNESSES = frozenset({Op.ACQUIRE, Op.TAKEOVER, Op.HEARTBEAT, Op.RELEASE, Op.ISSUE_GRANT,
                        Op.VALIDATE})
# Operations that act on an existing lease and must not succeed once it is over.
_USES = frozenset({Op.HEARTBEAT, Op.RELEASE, Op.ISSUE_GRANT, Op.VALIDATE})
_ESTABLISH = frozenset({Op.ACQUIRE, Op.TAKEOVER})
_EXTEND = frozenset({Op.ACQUIRE, Op.TAKEOVER, Op.HEARTBEAT})


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One operation as a worker saw it.

    ``epoch``/``lease_id``/``expires_at`` describe the lease the operation succeeded on (for
    a validation: the context it returned; for a grant issue: the grant). For a refusal
    ``epoch`` is the epoch the caller presented. ``audit_key`` is the correlation id under
    which the library audits this operation: its own correlation id, except for the
    validation of a recognized grant, which the library audits under the grant's.
    ``audit_optional`` marks a refusal whose audit append the library reported as lost
    (best effort by design for validations when the store fails).
    """

    process: str
    n: int
    op: Op
    identity: Ident
    connector_id: str
    correlation_id: str
    status: Status
    start: datetime
    end: datetime | None
    reason: str | None = None
    epoch: int | None = None
    lease_id: str | None = None
    expires_at: datetime | None = None
    grant_id: str | None = None
    audit_key: str | None = None
    audit_optional: bool = False
    reconciled: bool = False
    detail: str = ""
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.audit_key if self.audit_key is not None else self.correlation_id


@dataclass(frozen=True, slots=True)
class AuditRow:
    """One row of ``connector_lease_audit_log``."""

    seq: int
    event_id: str
    event: str
    outcome: str
    reason: str | None
    identity: Ident
    connector_id: str
    epoch: int | None
    correlation_id: str
    recorded_at: datetime


@dataclass(frozen=True, slots=True)
class FinalRow:
    """The lease row of an identity at the end of a run."""

    identity: Ident
    lease_id: str
    epoch: int


class Kind(enum.StrEnum):
    TWO_VALID_LEASES = "two_valid_leases"
    STALE_ACCEPTED = "stale_accepted"
    EXPIRED_ACCEPTED = "expired_accepted"
    RELEASED_ACCEPTED = "released_accepted"
    GRANT_EXPIRED_ACCEPTED = "grant_expired_accepted"
    EPOCH_NOT_INCREASING = "epoch_not_increasing"
    EPOCH_GAP = "epoch_gap"
    EPOCH_WINNERS = "epoch_winners"
    AUDIT_MISSING = "audit_missing"
    AUDIT_DUPLICATE = "audit_duplicate"
    AUDIT_ORPHAN = "audit_orphan"
    FINAL_STATE = "final_state"
    RENEWED_AFTER_SEEN_EXPIRED = "renewed_after_seen_expired"
    MALFORMED = "malformed"


@dataclass(frozen=True, slots=True)
class Violation:
    kind: Kind
    identity: Ident | None
    detail: str

    def __str__(self) -> str:
        where = "/".join(self.identity) if self.identity is not None else "-"
        return f"{self.kind}: {where}: {self.detail}"


def _name(record: OpRecord) -> str:
    return f"{record.process}#{record.n} {record.op}"


# --- the checker ---------------------------------------------------------------------------


def check_history(records: Sequence[OpRecord], audit_rows: Sequence[AuditRow], *,
                  final_rows: Sequence[FinalRow] | None = None,
                  initial_epochs: Mapping[Ident, int] | None = None,
                  audited: bool = True) -> list[Violation]:
    """Every violation the records and the audit log prove; an empty list means none.

    ``audit_rows`` must be all rows of the run's identities (and only those), in any order.
    ``initial_epochs`` gives identities whose row was set up outside the library (their epoch
    before the run). ``audited=False`` skips the audit matching, for runs whose records do not
    cover every operation on their identities.
    """
    violations: list[Violation] = []
    violations += _check_malformed(records)
    by_identity: dict[Ident, list[OpRecord]] = defaultdict(list)
    for record in records:
        by_identity[record.identity].append(record)
    for identity, ops in by_identity.items():
        violations += _check_winners(identity, ops)
        violations += _check_stale(identity, ops)
        violations += _check_expiry(identity, ops)
    violations += _check_audit_epochs(audit_rows, initial_epochs or {})
    violations += _check_seen_expired(audit_rows)
    if audited:
        violations += _check_audit_matches(records, audit_rows)
    if final_rows is not None:
        violations += _check_final(records, audit_rows, final_rows, initial_epochs or {})
    return violations


def _check_malformed(records: Sequence[OpRecord]) -> Iterator[Violation]:
    for r in records:
        if r.end is not None and r.end < r.start:
            yield Violation(Kind.MALFORMED, r.identity, f"{_name(r)} ends before it starts")
        if r.status is Status.OK and r.op is not Op.VALIDATE and r.epoch is None:
            yield Violation(Kind.MALFORMED, r.identity, f"{_name(r)} succeeded without epoch")
        if r.status is Status.OK and r.end is None:
            yield Violation(Kind.MALFORMED, r.identity, f"{_name(r)} succeeded without end")


def _check_winners(identity: Ident, ops: Sequence[OpRecord]) -> Iterator[Violation]:
    """One lease id per epoch among everything observed; one winning acquire/takeover."""
    lease_ids: dict[int, set[str]] = defaultdict(set)
    winners: dict[int, list[OpRecord]] = defaultdict(list)
    for r in ops:
        if r.status is not Status.OK or r.epoch is None:
            continue
        if r.lease_id is not None:
            lease_ids[r.epoch].add(r.lease_id)
        if r.op in _ESTABLISH:
            winners[r.epoch].append(r)
    for epoch, ids in sorted(lease_ids.items()):
        if len(ids) > 1:
            yield Violation(Kind.EPOCH_WINNERS, identity,
                            f"epoch {epoch} observed with {len(ids)} lease ids")
    for epoch, won in sorted(winners.items()):
        if len(won) > 1:
            names = ", ".join(_name(r) for r in won[:4])
            yield Violation(Kind.EPOCH_WINNERS, identity,
                            f"epoch {epoch} won {len(won)} times ({names})")


def _check_stale(identity: Ident, ops: Sequence[OpRecord]) -> Iterator[Violation]:
    """A lower epoch accepted after a higher epoch was observed valid."""
    # For each epoch, the earliest end of an operation proving it valid; a takeover wins a
    # tie, so the violation is named after it ("after a newer takeover").
    earliest: dict[int, tuple[datetime, OpRecord]] = {}
    for r in ops:
        if r.status is Status.OK and r.epoch is not None and r.end is not None \
                and r.op in _WITNESSES:
            best = earliest.get(r.epoch)
            if best is None or r.end < best[0] or (r.end == best[0] and r.op is Op.TAKEOVER):
                earliest[r.epoch] = (r.end, r)
    # Suffix minimum over epochs: for each epoch, the earliest proof of any higher epoch.
    newer: dict[int, tuple[datetime, OpRecord] | None] = {}
    best_above: tuple[datetime, OpRecord] | None = None
    for epoch in sorted(earliest, reverse=True):
        newer[epoch] = best_above
        candidate = earliest[epoch]
        if best_above is None or candidate[0] < best_above[0]:
            best_above = candidate
    for r in ops:
        if r.status is not Status.OK or r.epoch is None or r.op not in _WITNESSES:
            continue
        proof = newer.get(r.epoch)
        if proof is not None and r.start > proof[0]:
            kind = Kind.STALE_ACCEPTED if proof[1].op is Op.TAKEOVER else Kind.TWO_VALID_LEASES
            yield Violation(kind, identity,
                            f"{_name(r)} accepted epoch {r.epoch} at {r.start.isoformat()}, "
                            f"after {_name(proof[1])} showed epoch {proof[1].epoch} valid at "
                            f"{proof[0].isoformat()}")


def _check_expiry(identity: Ident, ops: Sequence[OpRecord]) -> Iterator[Violation]:
    """Nothing accepted after the lease's last possible expiry, its release, or (for a
    validation) the grant's own expiry."""
    by_lease: dict[str, list[OpRecord]] = defaultdict(list)
    grant_expiry: dict[str, datetime] = {}
    for r in ops:
        if r.lease_id is not None:
            by_lease[r.lease_id].append(r)
        if r.op is Op.ISSUE_GRANT and r.status is Status.OK and r.grant_id is not None \
                and r.expires_at is not None:
            grant_expiry[r.grant_id] = r.expires_at
    # Renewals whose outcome is unknown carry no lease id in their result but may have
    # moved the expiry; they are matched by the lease they presented.
    unknown_renewals: dict[str, list[OpRecord]] = defaultdict(list)
    for r in ops:
        presented = r.args.get("lease_id")
        if r.op is Op.HEARTBEAT and r.status is Status.UNKNOWN and isinstance(presented, str):
            unknown_renewals[presented].append(r)
    for lease_id, lease_ops in by_lease.items():
        extends = [r for r in lease_ops if r.status is Status.OK and r.op in _EXTEND
                   and r.expires_at is not None]
        releases = [r for r in lease_ops if r.status is Status.OK and r.op is Op.RELEASE
                    and r.end is not None]
        first_release = min((r.end for r in releases if r.end is not None), default=None)
        for r in lease_ops:
            if r.status is not Status.OK or r.op not in _USES:
                continue
            end = r.end if r.end is not None else r.start
            if r.op is not Op.RELEASE and first_release is not None and r.start > first_release:
                yield Violation(Kind.RELEASED_ACCEPTED, identity,
                                f"{_name(r)} accepted lease {lease_id} after its release "
                                f"returned at {first_release.isoformat()}")
            # The latest expiry any renewal that started before this call ended could have
            # set. An in-doubt renewal could have set one we do not know: skip then.
            if any(u.start <= end for u in unknown_renewals.get(lease_id, [])):
                continue
            # A renewal is judged by the expiries before it, never by the one it set.
            known = [x.expires_at for x in extends
                     if x is not r and x.start <= end and x.expires_at is not None]
            if known and r.start >= max(known):
                yield Violation(Kind.EXPIRED_ACCEPTED, identity,
                                f"{_name(r)} accepted lease {lease_id} at "
                                f"{r.start.isoformat()}, expired at {max(known).isoformat()}")
        for r in lease_ops:
            if r.op is Op.VALIDATE and r.status is Status.OK and r.grant_id is not None:
                expiry = grant_expiry.get(r.grant_id)
                if expiry is not None and r.start >= expiry:
                    yield Violation(Kind.GRANT_EXPIRED_ACCEPTED, identity,
                                    f"{_name(r)} accepted grant {r.grant_id} at "
                                    f"{r.start.isoformat()}, expired at {expiry.isoformat()}")


def _check_audit_epochs(rows: Sequence[AuditRow], initial: Mapping[Ident, int]
                        ) -> Iterator[Violation]:
    """Success rows, in log order: epoch 1 on acquisition, +1 per takeover, and the current
    epoch on every renewal, release and grant issue."""
    by_identity: dict[Ident, list[AuditRow]] = defaultdict(list)
    for row in rows:
        by_identity[row.identity].append(row)
    for identity, id_rows in by_identity.items():
        current = initial.get(identity, 0)
        for row in sorted(id_rows, key=lambda r: r.seq):
            if row.outcome == DENIED:
                continue
            if row.outcome == "acquired":
                if current != 0 or row.epoch != 1:
                    yield Violation(Kind.EPOCH_WINNERS, identity,
                                    f"audit seq {row.seq}: acquired at epoch {row.epoch} when "
                                    f"the epoch was already {current}")
                current = max(current, row.epoch or 0)
            elif row.outcome == "taken_over":
                epoch = row.epoch or 0
                if epoch == current:
                    yield Violation(Kind.EPOCH_WINNERS, identity,
                                    f"audit seq {row.seq}: epoch {epoch} won twice")
                elif epoch < current:
                    yield Violation(Kind.EPOCH_NOT_INCREASING, identity,
                                    f"audit seq {row.seq}: takeover to epoch {epoch} after "
                                    f"epoch {current}")
                elif epoch > current + 1:
                    yield Violation(Kind.EPOCH_GAP, identity,
                                    f"audit seq {row.seq}: takeover to epoch {epoch} after "
                                    f"epoch {current}")
                current = max(current, epoch)
            elif row.outcome == "grant_issued":
                # A grant is minted from a read, and its row appended without the lease
                # row's lock: a takeover may commit in between, so an older (but once
                # current) epoch is fine here; the time-based checks judge its use.
                if row.epoch is None or not 1 <= row.epoch <= current:
                    yield Violation(Kind.STALE_ACCEPTED, identity,
                                    f"audit seq {row.seq}: grant issued at epoch {row.epoch} "
                                    f"while the current epoch was {current}")
            elif row.outcome in ("renewed", "released"):
                # Guarded writes under the row lock: only ever at the current epoch.
                if row.epoch != current:
                    yield Violation(Kind.STALE_ACCEPTED, identity,
                                    f"audit seq {row.seq}: {row.outcome} at epoch {row.epoch} "
                                    f"while the current epoch was {current}")
            else:
                yield Violation(Kind.AUDIT_ORPHAN, identity,
                                f"audit seq {row.seq}: unexpected outcome {row.outcome!r}")


def _check_seen_expired(rows: Sequence[AuditRow]) -> Iterator[Violation]:
    """No renewal or release of a lease after (in log order) a refusal that saw it expired:
    time is judged after the row lock, so such a write must be refused too."""
    by_identity: dict[Ident, list[AuditRow]] = defaultdict(list)
    for row in rows:
        by_identity[row.identity].append(row)
    for identity, id_rows in by_identity.items():
        seen: dict[int, AuditRow] = {}  # epoch -> the first refusal that saw it expired
        for row in sorted(id_rows, key=lambda r: r.seq):
            if row.epoch is None:
                continue
            if row.outcome == DENIED and row.reason == "lease_expired":
                seen.setdefault(row.epoch, row)
            elif row.outcome in ("renewed", "released") and row.epoch in seen:
                first = seen[row.epoch]
                yield Violation(Kind.RENEWED_AFTER_SEEN_EXPIRED, identity,
                                f"audit seq {row.seq}: {row.outcome} epoch {row.epoch} at "
                                f"{row.recorded_at.isoformat()} after seq {first.seq} "
                                f"({first.event}) saw it expired at "
                                f"{first.recorded_at.isoformat()}")


@dataclass(slots=True)
class _Slot:
    """An audit row an operation must (or may) have."""

    record: OpRecord
    required: bool
    outcome: str | None  # None: any outcome
    reason: str | None
    epoch: int | None
    check_epoch: bool


def _slots(record: OpRecord) -> list[_Slot]:
    if record.status is Status.OK:
        if record.op is Op.VALIDATE:
            return []  # successful validations are not audited
        return [_Slot(record, True, SUCCESS_OUTCOME[record.op], None, record.epoch, True)]
    if record.status is Status.DENIED:
        optional = record.audit_optional or record.reason == "store_unavailable"
        return [_Slot(record, not optional, DENIED, record.reason, record.epoch, False)]
    if record.status is Status.UNKNOWN:
        return [_Slot(record, False, None, None, None, False)]
    return []  # ERROR: nothing changed


def _fits(slot: _Slot, row: AuditRow) -> bool:
    if slot.outcome is not None and row.outcome != slot.outcome:
        return False
    if slot.outcome == DENIED and row.reason != slot.reason:
        return False
    if slot.check_epoch and row.epoch != slot.epoch:
        return False
    return row.identity == slot.record.identity and row.connector_id in (
        slot.record.connector_id, "unrecognized")


def _match(slots: list[_Slot], rows: list[AuditRow]) -> tuple[list[_Slot], list[AuditRow]]:
    """Match rows to slots; return the required slots left without a row and the rows left
    without a slot.

    Maximum bipartite matching by augmenting paths (groups are small: one correlation id).
    Required slots are matched first; augmenting never unmatches a matched slot, so the
    optional slots added afterwards cannot take a row a required slot needs.
    """
    owner: dict[int, int] = {}  # slot index -> row index

    def augment(r: int, seen: set[int], required_only: bool) -> bool:
        for s, slot in enumerate(slots):
            if s in seen or (required_only and not slot.required) or not _fits(slot, rows[r]):
                continue
            seen.add(s)
            if s not in owner or augment(owner[s], seen, required_only):
                owner[s] = r
                return True
        return False

    for r in range(len(rows)):
        augment(r, set(), True)
    matched_rows = set(owner.values())
    for r in range(len(rows)):
        if r not in matched_rows and augment(r, set(), False):
            matched_rows = set(owner.values())
    unmatched_rows = [rows[r] for r in range(len(rows)) if r not in matched_rows]
    missing = [slot for s, slot in enumerate(slots) if slot.required and s not in owner]
    return missing, unmatched_rows


def _check_audit_matches(records: Sequence[OpRecord], rows: Sequence[AuditRow]
                         ) -> Iterator[Violation]:
    slots: dict[tuple[str, str], list[_Slot]] = defaultdict(list)
    ops_by_key: dict[tuple[str, str], list[OpRecord]] = defaultdict(list)
    for record in records:
        key = (record.key, record.op.value)
        slots[key].extend(_slots(record))
        ops_by_key[key].append(record)
    grouped: dict[tuple[str, str], list[AuditRow]] = defaultdict(list)
    for row in rows:
        grouped[(row.correlation_id, row.event)].append(row)
    for key in sorted(set(slots) | set(grouped)):
        missing, extra = _match(slots.get(key, []), grouped.get(key, []))
        for slot in missing:
            r = slot.record
            yield Violation(Kind.AUDIT_MISSING, r.identity,
                            f"{_name(r)} {r.status} ({r.reason}) has no audit row "
                            f"{slot.outcome}/{slot.reason} under {key[0]!r}")
        for row in extra:
            ops = ops_by_key.get(key, [])
            kind = Kind.AUDIT_DUPLICATE if ops else Kind.AUDIT_ORPHAN
            what = ", ".join(f"{_name(r)}={r.status}" for r in ops[:3]) or "no operation"
            yield Violation(kind, row.identity,
                            f"audit seq {row.seq} {row.event}/{row.outcome}/{row.reason} "
                            f"epoch {row.epoch} under {row.correlation_id!r} matches none of: "
                            f"{what}")


def _check_final(records: Sequence[OpRecord], rows: Sequence[AuditRow],
                 final_rows: Sequence[FinalRow], initial: Mapping[Ident, int]
                 ) -> Iterator[Violation]:
    """The final row's epoch is the last audited one, and its lease id the one its winner
    was told about (when the winner's outcome is known)."""
    top: dict[Ident, int] = dict(initial)
    for row in rows:
        if row.outcome in ("acquired", "taken_over") and row.epoch is not None:
            top[row.identity] = max(top.get(row.identity, 0), row.epoch)
    winner: dict[tuple[Ident, int], str] = {}
    for r in records:
        if r.status is Status.OK and r.op in _ESTABLISH and r.epoch is not None \
                and r.lease_id is not None:
            winner[(r.identity, r.epoch)] = r.lease_id
    seen = set()
    for final in final_rows:
        seen.add(final.identity)
        expected = top.get(final.identity)
        if expected is not None and final.epoch != expected:
            yield Violation(Kind.FINAL_STATE, final.identity,
                            f"row is at epoch {final.epoch}, audit log ends at {expected}")
        told = winner.get((final.identity, final.epoch))
        if told is not None and told != final.lease_id:
            yield Violation(Kind.FINAL_STATE, final.identity,
                            f"row holds lease {final.lease_id}, winner of epoch {final.epoch} "
                            f"was told {told}")
    for identity in top:
        if identity not in seen and identity not in initial:
            yield Violation(Kind.FINAL_STATE, identity, "audited acquisition but no lease row")


# --- summaries -----------------------------------------------------------------------------


def count(records: Iterable[OpRecord], op: Op | None = None,
          status: Status | None = None) -> int:
    return sum(1 for r in records
               if (op is None or r.op is op) and (status is None or r.status is status))


# --- serialization: one JSON object per line, written as operations happen ---------------


def _dt(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _parse_dt(value: object) -> datetime | None:
    return None if value is None else datetime.fromisoformat(str(value))


def record_to_json(record: OpRecord) -> str:
    return json.dumps({
        "kind": "op", "process": record.process, "n": record.n, "op": record.op.value,
        "identity": list(record.identity), "connector_id": record.connector_id,
        "correlation_id": record.correlation_id, "status": record.status.value,
        "start": _dt(record.start), "end": _dt(record.end), "reason": record.reason,
        "epoch": record.epoch, "lease_id": record.lease_id,
        "expires_at": _dt(record.expires_at), "grant_id": record.grant_id,
        "audit_key": record.audit_key, "audit_optional": record.audit_optional,
        "reconciled": record.reconciled, "detail": record.detail, "args": dict(record.args),
    }, separators=(",", ":"))


def start_to_json(process: str, n: int, op: Op, identity: Ident, connector_id: str,
                  correlation_id: str, start: datetime, audit_key: str | None,
                  args: Mapping[str, Any]) -> str:
    """The line written before a call: if the process dies during the call, it is all that
    is left, and the operation counts as one with an unknown outcome."""
    return json.dumps({
        "kind": "start", "process": process, "n": n, "op": op.value,
        "identity": list(identity), "connector_id": connector_id,
        "correlation_id": correlation_id, "start": _dt(start), "audit_key": audit_key,
        "args": dict(args),
    }, separators=(",", ":"))


def _ident(value: object) -> Ident:
    assert isinstance(value, list) and len(value) == 3
    return (str(value[0]), str(value[1]), str(value[2]))


def parse_lines(lines: Iterable[str]) -> list[OpRecord]:
    """Records from a worker's log; a started call that never finished is ``UNKNOWN``.

    A torn last line (the process was killed mid-write) is ignored.
    """
    finished: dict[tuple[str, int], OpRecord] = {}
    started: dict[tuple[str, int], dict[str, Any]] = {}
    for raw in lines:
        text = raw.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            continue
        key = (str(obj["process"]), int(obj["n"]))
        if obj["kind"] == "start":
            started[key] = obj
            continue
        start = _parse_dt(obj["start"])
        assert start is not None
        finished[key] = OpRecord(
            process=key[0], n=key[1], op=Op(obj["op"]), identity=_ident(obj["identity"]),
            connector_id=obj["connector_id"], correlation_id=obj["correlation_id"],
            status=Status(obj["status"]), start=start, end=_parse_dt(obj["end"]),
            reason=obj["reason"], epoch=obj["epoch"], lease_id=obj["lease_id"],
            expires_at=_parse_dt(obj["expires_at"]), grant_id=obj["grant_id"],
            audit_key=obj["audit_key"], audit_optional=bool(obj["audit_optional"]),
            reconciled=bool(obj["reconciled"]), detail=obj["detail"], args=obj["args"])
    for key, obj in started.items():
        if key in finished:
            continue
        start = _parse_dt(obj["start"])
        assert start is not None
        finished[key] = OpRecord(
            process=key[0], n=key[1], op=Op(obj["op"]), identity=_ident(obj["identity"]),
            connector_id=obj["connector_id"], correlation_id=obj["correlation_id"],
            status=Status.UNKNOWN, start=start, end=None, audit_key=obj["audit_key"],
            detail="process ended during the call", args=obj["args"])
    return sorted(finished.values(), key=lambda r: (r.start, r.process, r.n))


def read_records(paths: Iterable[Path]) -> list[OpRecord]:
    lines: list[str] = []
    for path in paths:
        if path.exists():
            lines += path.read_text("utf-8", errors="replace").splitlines()
    return parse_lines(lines)
