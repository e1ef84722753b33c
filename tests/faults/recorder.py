"""The recorder every worker operation goes through.

:class:`Recorder` reads the database clock before and after each library call and appends
one JSON line per operation to the worker's history file (and, where the worker may be
killed, a line before the call too, so an operation cut short by SIGKILL is still known to
have started). :func:`describe` turns a library result into the checker's terms.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from mos_lease import (
    CommitOutcomeUnknown,
    GrantResult,
    InvalidInput,
    InvocationResult,
    LeaseIdentity,
    LeaseResult,
    MosLeaseError,
    StoreUnavailable,
    ValidationResult,
)
from tests.faults import clockskew
from tests.faults.dbclock import DbClock
from tests.faults.history import Ident, Op, OpRecord, Status, record_to_json, start_to_json

T = TypeVar("T")


def ident(identity: LeaseIdentity) -> Ident:
    return (identity.tenant_id, identity.logical_agent_id, identity.binding_id)


class _AuditLossWatch(logging.Handler):
    """Notices the coordinator's warning that a denied validation's audit row was lost, so
    that the record can say the row may be missing (best effort by design)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        if "could not audit" in record.getMessage():
            self.local.lost = True


_WATCH = _AuditLossWatch()
logging.getLogger("mos_lease").addHandler(_WATCH)


@dataclass
class Outcome:
    status: Status
    reason: str | None = None
    epoch: int | None = None
    lease_id: str | None = None
    expires_at: datetime | None = None
    grant_id: str | None = None
    reconciled: bool = False
    detail: str = ""
    crashed: bool = False


def describe(result: object, presented_epoch: int | None) -> Outcome:
    """What a library result says, in the checker's terms."""
    if isinstance(result, LeaseResult):
        if result.ok and result.lease is not None:
            lease = result.lease
            return Outcome(Status.OK, None, lease.epoch, str(lease.lease_id), lease.expires_at,
                           reconciled=result.reconciled)
        return Outcome(Status.DENIED, str(result.reason), presented_epoch,
                       reconciled=result.reconciled)
    if isinstance(result, GrantResult):
        if result.ok and result.grant is not None:
            grant = result.grant
            return Outcome(Status.OK, None, grant.epoch, str(grant.lease_id), grant.expires_at,
                           grant_id=str(grant.grant_id))
        return Outcome(Status.DENIED, str(result.reason), presented_epoch)
    if isinstance(result, ValidationResult | InvocationResult):
        if result.ok and result.context is not None:
            ctx = result.context
            return Outcome(Status.OK, None, ctx.epoch, str(ctx.lease_id), ctx.expires_at)
        return Outcome(Status.DENIED, str(result.reason), presented_epoch)
    raise TypeError(f"not a library result: {type(result).__name__}")


def describe_error(exc: BaseException) -> Outcome:
    if isinstance(exc, InvalidInput):
        # Refused before anything was read or written: nothing changed, like ERROR.
        return Outcome(Status.ERROR, detail=f"InvalidInput: {exc}")
    if isinstance(exc, StoreUnavailable):
        return Outcome(Status.ERROR, detail=f"StoreUnavailable: {exc}")
    if isinstance(exc, CommitOutcomeUnknown):
        return Outcome(Status.UNKNOWN, detail=f"CommitOutcomeUnknown {exc.event_id}")
    # Anything else (InternalInconsistency, a driver error leaking out, a bug) is a crash
    # of the operation: its outcome is unknown to the caller, and it is counted as a crash.
    return Outcome(Status.UNKNOWN, detail=f"crash: {type(exc).__name__}: {exc}", crashed=True)


class Recorder:
    """Runs library calls and writes one history line per call (thread-safe).

    ``durable`` also writes a line before each call (for workers that may be killed).
    Each thread reads the database clock on a connection of its own.
    """

    def __init__(self, path: Path, process: str, clock_dsn: str, *,
                 durable: bool = False) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.process = process
        self._clock_dsn = clock_dsn
        self.durable = durable
        self._lock = threading.Lock()
        self._n = 0
        self._local = threading.local()
        self._clocks: list[DbClock] = []
        self.records: list[OpRecord] = []
        self.crashes: list[str] = []
        self.last_error: BaseException | None = None

    def clock(self) -> DbClock:
        clock: DbClock | None = getattr(self._local, "clock", None)
        if clock is None:
            clock = DbClock(self._clock_dsn)
            self._local.clock = clock
            with self._lock:
                self._clocks.append(clock)
        return clock

    def _write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        with self._lock:
            os.write(self._fd, data)

    def call(self, op: Op, identity: LeaseIdentity, connector_id: str, correlation_id: str,
             fn: Callable[[], T], *, audit_key: str | None = None,
             presented_epoch: int | None = None, args: Mapping[str, Any] | None = None,
             ) -> tuple[T | None, OpRecord]:
        """Run ``fn`` (one library call) and record it. Returns its result (``None`` if it
        raised) and the record. Library exceptions are recorded, not raised."""
        with self._lock:
            self._n += 1
            n = self._n
        clock = self.clock()
        all_args = dict(args or {})
        if presented_epoch is not None:
            all_args.setdefault("epoch", presented_epoch)
        all_args["m0"] = clockskew.real_monotonic()
        start = clock.now()
        if self.durable:
            self._write(start_to_json(self.process, n, op, ident(identity), connector_id,
                                      correlation_id, start, audit_key, all_args))
        _WATCH.local.lost = False
        result: T | None = None
        try:
            result = fn()
            outcome = describe(result, presented_epoch)
        except MosLeaseError as exc:
            outcome = describe_error(exc)
            self.last_error = exc
        except Exception as exc:  # recorded as a crash; the scenario fails on crashes
            outcome = describe_error(exc)
            self.last_error = exc
        all_args["m1"] = clockskew.real_monotonic()
        end = clock.now()
        if clock.estimated:
            all_args["estimated"] = True
        key = audit_key
        if op is Op.VALIDATE and outcome.reason == "grant_unknown":
            key = None  # an unrecognized object is audited under the call's own id
        record = OpRecord(
            process=self.process, n=n, op=op, identity=ident(identity),
            connector_id=connector_id, correlation_id=correlation_id, status=outcome.status,
            start=start, end=end, reason=outcome.reason, epoch=outcome.epoch,
            lease_id=outcome.lease_id, expires_at=outcome.expires_at,
            grant_id=outcome.grant_id if outcome.grant_id is not None else all_args.get(
                "grant_id"),
            audit_key=key, audit_optional=bool(getattr(_WATCH.local, "lost", False)),
            reconciled=outcome.reconciled, detail=outcome.detail, args=all_args)
        self._write(record_to_json(record))
        with self._lock:
            self.records.append(record)
            if outcome.crashed:
                self.crashes.append(f"{op} {outcome.detail}")
        return result, record

    def call_batch(self, op: Op, items: Sequence[tuple[LeaseIdentity, str, int, Mapping[str, Any]]],
                   correlation_id: str, fn: Callable[[], list[T]]) -> list[OpRecord]:
        """Record one batched call (``heartbeat_many``) as one record per item, all under
        the batch's correlation id (the library audits every item under it)."""
        clock = self.clock()
        m0 = clockskew.real_monotonic()
        start = clock.now()
        _WATCH.local.lost = False
        outcomes: list[Outcome]
        try:
            results = fn()
            outcomes = [describe(result, epoch) for result, (_, _, epoch, _) in
                        zip(results, items, strict=True)]
        except Exception as exc:  # one failure is every item's outcome
            self.last_error = exc
            outcomes = [describe_error(exc)] * len(items)
        m1 = clockskew.real_monotonic()
        end = clock.now()
        made = []
        for (identity, connector_id, epoch, args), outcome in zip(items, outcomes, strict=True):
            with self._lock:
                self._n += 1
                n = self._n
            record = OpRecord(
                process=self.process, n=n, op=op, identity=ident(identity),
                connector_id=connector_id, correlation_id=correlation_id,
                status=outcome.status, start=start, end=end, reason=outcome.reason,
                epoch=outcome.epoch, lease_id=outcome.lease_id, expires_at=outcome.expires_at,
                reconciled=outcome.reconciled, detail=outcome.detail,
                args={**args, "epoch": epoch, "m0": m0, "m1": m1, "batch": len(items)})
            self._write(record_to_json(record))
            with self._lock:
                self.records.append(record)
                if outcome.crashed:
                    self.crashes.append(f"{op} {outcome.detail}")
            made.append(record)
        return made

    def close(self) -> None:
        for clock in self._clocks:
            clock.close()
        os.close(self._fd)

    def tally(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            key = f"{r.op}:{r.status}"
            counts[key] = counts.get(key, 0) + 1
        return counts
