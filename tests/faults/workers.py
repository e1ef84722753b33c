"""Worker processes of the fault scenarios, and the recorder every operation goes through.

Each worker is its own OS process (``python -m tests.faults.workers ROLE CONFIG.json``) with
its own PostgreSQL connection and its own coordinator, as separate gateway processes would
be. Every lifecycle call goes through :class:`Recorder`, which reads the database clock
before and after it and appends one JSON line per operation to the worker's history file
(and, where the worker may be killed, a line before the call too, so an operation cut short
by SIGKILL is still known to have started).

Roles (one function each, named in :data:`ROLES`): ``race`` (scenario 1), ``storm`` (2),
``holder`` (3), ``victim`` (4), ``load`` (6), ``skew`` (7) and ``smuggle`` (10).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID

import psycopg

from mos_lease import (
    AllowAllPolicy,
    CommitOutcomeUnknown,
    ConnectorLeaseCoordinator,
    ConnectorLeaseService,
    ExecutionGrant,
    GrantResult,
    InvalidInput,
    InvocationResult,
    LeaseHandle,
    LeaseIdentity,
    LeaseResult,
    MosLeaseError,
    StaticConnectorPolicy,
    StoreUnavailable,
    ValidationResult,
)
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from tests.faults import clockskew
from tests.faults.history import Ident, Op, OpRecord, Status, record_to_json, start_to_json

T = TypeVar("T")
SCOPES = ("tool:read", "tool:run")
Config = Mapping[str, Any]


def ident(identity: LeaseIdentity) -> Ident:
    return (identity.tenant_id, identity.logical_agent_id, identity.binding_id)


# --- the database clock ---------------------------------------------------------------------


class DbClock:
    """``clock_timestamp()`` on a connection of its own (never the store's, so the clock
    keeps working while a scenario breaks the store's connection).

    While the server is down the time is estimated from the host's monotonic clock and the
    last offset measured (same host, so the estimate is good to a few milliseconds); such
    readings are flagged ``estimated``.
    """

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: psycopg.Connection[Any] | None = None
        self._offset: float | None = None  # database epoch seconds - real monotonic
        self._retry_at = 0.0
        self.estimated = False

    def now(self) -> datetime:
        mono = clockskew.real_monotonic()
        if mono >= self._retry_at:
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._close()
                    self._conn = psycopg.connect(self._dsn, autocommit=True,
                                                 connect_timeout=2,
                                                 application_name="faults-clock")
                row = self._conn.execute("SELECT clock_timestamp()", prepare=True).fetchone()
                assert row is not None
                value: datetime = row[0].astimezone(UTC)
                after = clockskew.real_monotonic()
                self._offset = value.timestamp() - (mono + after) / 2
                self.estimated = False
                return value
            except psycopg.Error:
                self._close()
                self._retry_at = clockskew.real_monotonic() + 0.05
        if self._offset is None:
            raise StoreUnavailable("database clock never read")
        self.estimated = True
        return datetime.fromtimestamp(clockskew.real_monotonic() + self._offset, UTC)

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._close()


# --- the recorder -----------------------------------------------------------------------------


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


# --- a gateway process ------------------------------------------------------------------------


def no_preempt_policy() -> ConnectorLeaseService:
    """Everything allowed except preempting an active lease: takeovers only follow expiry
    or release, so decisions depend on time alone (scenario 7's oracle needs that)."""
    return StaticConnectorPolicy.from_dict({"rules": [{
        "tenant_id": "*", "logical_agent_id": "*", "binding_id": "*", "connector_id": "*",
        "scopes": list(SCOPES), "max_lease_ttl": 300, "max_grant_ttl": 30,
        "preempt_active": False}]})


def _seconds(cfg: Config, key: str, default: timedelta | None) -> timedelta | None:
    return timedelta(seconds=float(cfg[key])) if key in cfg else default


class Gateway:
    """One gateway: a store on its own connection, a coordinator, a recorder."""

    def __init__(self, cfg: Config, store: PostgresLeaseStore | None = None) -> None:
        """``store`` replaces the dedicated-connection store built from ``cfg["dsn"]`` (for
        a pooled store)."""
        self.cfg = cfg
        self.process = str(cfg["process"])
        self.connector = str(cfg.get("connector", self.process))
        defaults = ConnectionSettings()
        settings = ConnectionSettings(
            statement_timeout=_seconds(cfg, "statement_timeout", defaults.statement_timeout),
            lock_timeout=_seconds(cfg, "lock_timeout", defaults.lock_timeout),
            connect_timeout=float(cfg.get("connect_timeout", 2)),
            application_name=f"faults-{self.process}"[:60])
        self.store = store if store is not None else PostgresLeaseStore(str(cfg["dsn"]),
                                                                        settings=settings)
        policy = no_preempt_policy() if cfg.get("policy") == "no_preempt" else AllowAllPolicy()
        self.coordinator = ConnectorLeaseCoordinator(self.store, policy)
        self.rec = Recorder(Path(cfg["records"]), self.process,
                            str(cfg.get("clock_dsn", cfg["dsn"])),
                            durable=bool(cfg.get("durable", False)))
        self._seq = 0
        self.deadline = clockskew.real_monotonic() + float(cfg.get("max_seconds", 60))

    def corr(self, tag: str) -> str:
        self._seq += 1
        return f"{self.process}-{tag}{self._seq}"

    def out_of_time(self) -> bool:
        return clockskew.real_monotonic() >= self.deadline

    # Each wrapper records one lifecycle call.

    def acquire(self, identity: LeaseIdentity, ttl: float) -> LeaseResult | None:
        corr = self.corr("a")
        result, _ = self.rec.call(Op.ACQUIRE, identity, self.connector, corr, lambda: (
            self.coordinator.acquire(identity, self.connector, scopes=SCOPES, ttl=ttl,
                                     correlation_id=corr)))
        return result

    def takeover(self, identity: LeaseIdentity, ttl: float,
                 expected_epoch: int) -> LeaseResult | None:
        corr = self.corr("t")
        result, _ = self.rec.call(Op.TAKEOVER, identity, self.connector, corr, lambda: (
            self.coordinator.takeover(identity, self.connector, scopes=SCOPES, ttl=ttl,
                                      expected_epoch=expected_epoch, correlation_id=corr)),
            presented_epoch=expected_epoch, args={"expected_epoch": expected_epoch})
        return result

    def heartbeat(self, lease: LeaseHandle, ttl: float) -> LeaseResult | None:
        corr = self.corr("h")
        result, _ = self.rec.call(Op.HEARTBEAT, lease.identity, lease.connector_id, corr,
                                  lambda: self.coordinator.heartbeat(lease, ttl=ttl,
                                                                     correlation_id=corr),
                                  presented_epoch=lease.epoch,
                                  args={"lease_id": str(lease.lease_id)})
        return result

    def release(self, lease: LeaseHandle) -> LeaseResult | None:
        corr = self.corr("r")
        result, _ = self.rec.call(Op.RELEASE, lease.identity, lease.connector_id, corr,
                                  lambda: self.coordinator.release(lease, correlation_id=corr),
                                  presented_epoch=lease.epoch,
                                  args={"lease_id": str(lease.lease_id)})
        return result

    def issue_grant(self, lease: LeaseHandle, ttl: float) -> GrantResult | None:
        corr = self.corr("g")
        result, _ = self.rec.call(Op.ISSUE_GRANT, lease.identity, lease.connector_id, corr,
                                  lambda: self.coordinator.issue_grant(
                                      lease, scopes=SCOPES, ttl=ttl, correlation_id=corr),
                                  presented_epoch=lease.epoch,
                                  args={"lease_id": str(lease.lease_id)})
        return result

    def validate(self, grant: ExecutionGrant, identity: LeaseIdentity | None = None,
                 scopes: tuple[str, ...] = SCOPES, tag: str = "v") -> ValidationResult | None:
        """Validate ``grant`` (genuine or not: its fields are read only for the record).
        ``tag`` marks the correlation id (``replay`` for grants rebuilt from elsewhere)."""
        target = identity if identity is not None else grant.identity
        corr = self.corr(tag)
        result, _ = self.rec.call(
            Op.VALIDATE, target, grant.connector_id, corr,
            lambda: self.coordinator.validate(grant, identity=target, scopes=scopes,
                                              correlation_id=corr),
            audit_key=grant.correlation_id, presented_epoch=grant.epoch,
            args={"grant_id": str(grant.grant_id), "lease_id": str(grant.lease_id)})
        return result

    def heartbeat_many(self, leases: list[LeaseHandle], ttl: float) -> list[OpRecord]:
        corr = self.corr("hm")
        items = [(lease.identity, lease.connector_id, lease.epoch,
                  {"lease_id": str(lease.lease_id)}) for lease in leases]
        return self.rec.call_batch(Op.HEARTBEAT, items, corr, lambda: (
            self.coordinator.heartbeat_many(leases, ttl=ttl, correlation_id=corr)))

    def close(self) -> None:
        self.store.close()
        self.rec.close()

    def summary(self, **extra: Any) -> None:
        out = {"process": self.process, "ops": len(self.rec.records),
               "tally": self.rec.tally(), "crashes": self.rec.crashes[:20], **extra}
        print("SUMMARY " + json.dumps(out, default=str), flush=True)


def say(word: str) -> None:
    print(word, flush=True)


def wait_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "GO":
        raise SystemExit(f"expected GO, got {line!r}")


def identities(cfg: Config, key: str = "bindings") -> list[LeaseIdentity]:
    return [LeaseIdentity(str(cfg["tenant"]), str(cfg.get("agent", "agent")), str(b))
            for b in cfg[key]]


def stop_requested(cfg: Config) -> bool:
    path = cfg.get("stop_file")
    return path is not None and os.path.exists(str(path))


# --- roles ------------------------------------------------------------------------------------


def role_race(cfg: Config) -> None:
    """Scenario 1: acquire every identity, in the same order as every other racer."""
    gw = Gateway(cfg)
    idents = identities(cfg)
    gw.rec.clock().now()  # connect the clock before the start line
    say("READY")
    wait_go()
    wins = 0
    for identity in idents:
        result = gw.acquire(identity, ttl=60)
        wins += bool(result is not None and result.ok)
    gw.summary(wins=wins)
    gw.close()


def role_storm(cfg: Config) -> None:
    """Scenario 2: take over shared identities round after round (preemption allowed), mint a
    grant after every win, and keep validating the last few grants from a second thread."""
    gw = Gateway(cfg)
    idents = identities(cfg)
    rounds = int(cfg["rounds"])
    keep: deque[ExecutionGrant] = deque(maxlen=int(cfg.get("keep", 3)))
    lock = threading.Lock()
    stop = threading.Event()
    index = int(cfg.get("index", 0))

    def validator() -> None:
        # Validates old and new grants alike: every grant of an epoch that was taken over
        # since must be refused.
        while not stop.is_set() and not gw.out_of_time():
            with lock:
                grants = list(keep)
            if not grants:
                time.sleep(0.001)
                continue
            for grant in grants:
                gw.validate(grant)

    gw.rec.clock().now()
    say("READY")
    wait_go()
    threads = [threading.Thread(target=validator, daemon=True)
               for _ in range(int(cfg.get("validators", 1)))]
    for thread in threads:
        thread.start()
    won = 0
    done = 0
    for r in range(rounds):
        if gw.out_of_time():
            break
        identity = idents[(r + index) % len(idents)]
        try:
            snapshot = gw.store.load(identity)
        except StoreUnavailable:
            continue
        if snapshot.row is None:
            continue
        done += 1
        result = gw.takeover(identity, ttl=30, expected_epoch=snapshot.row.epoch)
        if result is None or not result.ok or result.lease is None:
            continue
        won += 1
        granted = gw.issue_grant(result.lease, ttl=30)
        if granted is not None and granted.grant is not None:
            with lock:
                keep.append(granted.grant)
            gw.validate(granted.grant)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    gw.summary(rounds=done, won=won)
    gw.close()


def role_holder(cfg: Config) -> None:
    """Scenario 3: hold a lease and keep using it (heartbeat, grant, validate) until told to
    stop; the harness freezes this process with SIGSTOP in between."""
    gw = Gateway(cfg)
    (identity,) = identities(cfg)
    ttl = float(cfg["ttl"])
    acquired = gw.acquire(identity, ttl=ttl)
    if acquired is None or acquired.lease is None:
        gw.summary(error="could not acquire")
        gw.close()
        return
    lease = acquired.lease
    kept: deque[ExecutionGrant] = deque(maxlen=4)
    say("READY")
    while not stop_requested(cfg) and not gw.out_of_time():
        beat = gw.heartbeat(lease, ttl=ttl)
        if beat is not None and beat.ok and beat.lease is not None:
            lease = beat.lease  # same lease id and epoch, later expiry
        granted = gw.issue_grant(lease, ttl=min(ttl, 30.0))
        if granted is not None and granted.grant is not None:
            kept.append(granted.grant)
        for grant in list(kept):
            gw.validate(grant)
        time.sleep(0.005)
    gw.summary()
    gw.close()


def _grant_fields(grant: ExecutionGrant) -> dict[str, Any]:
    return {"grant_id": str(grant.grant_id), "identity": list(ident(grant.identity)),
            "connector_id": grant.connector_id, "lease_id": str(grant.lease_id),
            "epoch": grant.epoch, "scopes": list(grant.scopes),
            "expires_at": grant.expires_at.isoformat(), "correlation_id": grant.correlation_id,
            "mac": grant._mac.hex()}


def replica(fields: Mapping[str, Any]) -> ExecutionGrant:
    """A grant rebuilt field by field, MAC included, without the constructor: what a
    process that learned every byte of a grant could present."""
    grant = object.__new__(ExecutionGrant)
    values: dict[str, Any] = {
        "grant_id": UUID(fields["grant_id"]), "identity": LeaseIdentity(*fields["identity"]),
        "connector_id": fields["connector_id"], "lease_id": UUID(fields["lease_id"]),
        "epoch": fields["epoch"], "scopes": tuple(fields["scopes"]),
        "expires_at": datetime.fromisoformat(fields["expires_at"]),
        "correlation_id": fields["correlation_id"], "_mac": bytes.fromhex(fields["mac"]),
    }
    for name, value in values.items():
        object.__setattr__(grant, name, value)
    return grant


def read_dump(path: str | None) -> list[dict[str, Any]]:
    if path is None or not os.path.exists(path):
        return []
    out = []
    for line in Path(path).read_text("utf-8", "replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def _take_when_expired(gw: Gateway, identity: LeaseIdentity, ttl: float,
                       patience: float) -> tuple[LeaseHandle | None, float]:
    """Acquire, or take over once the current lease is over by database time. Returns the
    lease (``None`` if stuck) and the seconds it took."""
    began = clockskew.real_monotonic()
    while clockskew.real_monotonic() - began < patience:
        try:
            snapshot = gw.store.load(identity)
        except StoreUnavailable:
            time.sleep(0.05)
            continue
        row = snapshot.row
        if row is None:
            result = gw.acquire(identity, ttl=ttl)
        elif row.released_at is None and row.expires_at > snapshot.now:
            wait = (row.expires_at - snapshot.now).total_seconds()
            time.sleep(min(max(wait, 0.0) + 0.005, 0.5))
            continue
        else:
            result = gw.takeover(identity, ttl=ttl, expected_epoch=row.epoch)
        if result is not None and result.ok and result.lease is not None:
            return result.lease, clockskew.real_monotonic() - began
    return None, clockskew.real_monotonic() - began


def role_victim(cfg: Config) -> None:
    """Scenario 4: a gateway that is killed with SIGKILL while it works.

    On start it is the *restarted* gateway of the previous victim: it presents every grant
    the previous one minted (rebuilt byte for byte from its dump) and must have all refused,
    then takes each identity over once the old lease has expired (none may be stuck). Then
    it works (heartbeat, grant, validate, sometimes release and take over again) until the
    harness kills it, dumping each grant it mints before using it.
    """
    gw = Gateway({**cfg, "durable": True})
    idents = identities(cfg)
    ttl = float(cfg["ttl"])
    old = read_dump(cfg.get("prev_dump"))
    replayed_ok = 0
    for fields in old:
        forged = replica(fields)
        result = gw.validate(forged, tag="replay")
        replayed_ok += bool(result is not None and result.ok)
    leases: dict[LeaseIdentity, LeaseHandle] = {}
    stuck: list[str] = []
    waits: list[float] = []
    for identity in idents:
        lease, waited = _take_when_expired(gw, identity, ttl, patience=ttl + 5.0)
        waits.append(waited)
        if lease is None:
            stuck.append(str(identity))
        else:
            leases[identity] = lease
    if cfg.get("final"):
        gw.summary(replayed=len(old), replayed_ok=replayed_ok, stuck=stuck, waits=waits)
        gw.close()
        return
    dump_fd = os.open(str(cfg["dump"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    say("READY")
    rng = random.Random(int(cfg.get("seed", 0)))
    iteration = 0
    while not gw.out_of_time():
        iteration += 1
        for identity, lease in list(leases.items()):
            if rng.random() < 0.12:
                released = gw.release(lease)
                if released is not None and released.ok:
                    taken = gw.takeover(identity, ttl=ttl, expected_epoch=lease.epoch)
                    if taken is not None and taken.lease is not None:
                        leases[identity] = taken.lease
                continue
            beat = gw.heartbeat(lease, ttl=ttl)
            current = beat.lease if beat is not None and beat.lease is not None else lease
            leases[identity] = current
            granted = gw.issue_grant(current, ttl=min(ttl, 30.0))
            if granted is not None and granted.grant is not None:
                os.write(dump_fd, (json.dumps(_grant_fields(granted.grant)) + "\n").encode())
                gw.validate(granted.grant)
    os.close(dump_fd)
    gw.summary(replayed=len(old), replayed_ok=replayed_ok, stuck=stuck, waits=waits,
               iterations=iteration)
    gw.close()


def role_load(cfg: Config) -> None:
    """Scenario 6: steady work on own identities while the harness stops and restarts the
    server. A ``StoreUnavailable`` is transient: the worker keeps its lease and grant and
    tries again (validations included, which must be refused while the server is down).
    After a refusal or an in-doubt write it finds its lease again by rereading the row, as a
    gateway would."""
    gw = Gateway(cfg)
    idents = identities(cfg)
    ttl = float(cfg["ttl"])
    leases: dict[LeaseIdentity, LeaseHandle | None] = {}
    for identity in idents:
        leases[identity], _ = _take_when_expired(gw, identity, ttl, patience=10)
    say("READY")
    rng = random.Random(int(cfg.get("seed", 0)))
    grants: dict[LeaseIdentity, ExecutionGrant | None] = dict.fromkeys(idents)

    def lost() -> bool:
        # Refused, or outcome unknown: reread before going on. Unavailable: try again.
        return gw.rec.records[-1].status in (Status.DENIED, Status.UNKNOWN)

    while not stop_requested(cfg) and not gw.out_of_time():
        for identity in idents:
            grant = grants[identity]
            if grant is not None:
                gw.validate(grant)
            lease = leases[identity]
            if lease is None:
                lease = leases[identity] = _resync(gw, identity, ttl)
                if lease is None:
                    continue
            roll = rng.random()
            if roll < 0.08:
                released = gw.release(lease)
                if released is None or not released.ok:
                    leases[identity] = None if lost() else lease
                    continue
                taken = gw.takeover(identity, ttl=ttl, expected_epoch=lease.epoch)
                leases[identity] = taken.lease if taken is not None and taken.ok else None
                grants[identity] = None
            elif roll < 0.5:
                beat = gw.heartbeat(lease, ttl=ttl)
                if beat is not None and beat.ok:
                    leases[identity] = beat.lease
                elif lost():
                    leases[identity] = None
            else:
                granted = gw.issue_grant(lease, ttl=min(ttl, 30.0))
                if granted is not None and granted.grant is not None:
                    grants[identity] = granted.grant
                elif lost():
                    leases[identity] = None
        time.sleep(0.002)
    gw.summary()
    gw.close()


def _resync(gw: Gateway, identity: LeaseIdentity, ttl: float) -> LeaseHandle | None:
    """Find this connector's lease again after an error: adopt the row if it is ours and
    active, else take over once it is over."""
    try:
        snapshot = gw.store.load(identity)
    except MosLeaseError:
        return None
    row = snapshot.row
    if row is None:
        result = gw.acquire(identity, ttl=ttl)
    elif row.connector_id == gw.connector and row.released_at is None \
            and row.expires_at > snapshot.now:
        return LeaseHandle.of(row)  # a handle is plain data; the store matches every field
    elif row.released_at is not None or row.expires_at <= snapshot.now:
        result = gw.takeover(identity, ttl=ttl, expected_epoch=row.epoch)
    else:
        return None
    return result.lease if result is not None and result.ok else None


def role_skew(cfg: Config) -> None:
    """Scenario 7: a gateway with skewed clocks runs a seeded mix of operations on its own
    identities, by its own (wrong) sense of time; the harness judges every decision against
    an oracle of database time."""
    offset, rate = float(cfg["offset"]), float(cfg["rate"])
    if (offset, rate) != (0.0, 1.0) and clockskew.installed() != (offset, rate):
        raise SystemExit("clock skew was not installed")
    patched = clockskew.patch_library_datetimes() if clockskew.installed() else 0
    gw = Gateway({**cfg, "policy": "no_preempt"})
    idents = identities(cfg)
    ttl, grant_ttl = float(cfg["ttl"]), float(cfg["grant_ttl"])
    rng = random.Random(int(cfg.get("seed", 0)))
    leases: dict[LeaseIdentity, LeaseHandle | None] = dict.fromkeys(idents)
    epochs: dict[LeaseIdentity, int] = dict.fromkeys(idents, 0)
    grants: dict[LeaseIdentity, deque[ExecutionGrant]] = {i: deque(maxlen=3) for i in idents}
    # What this process believes, against the database clock: proof that the skew is on.
    db_start = gw.rec.clock().now()
    library_datetime = getattr(sys.modules["mos_lease.coordinator"], "datetime", datetime)
    observed = {"time_offset": time.time() - db_start.timestamp(),
                "datetime_offset": (library_datetime.now(UTC) - db_start).total_seconds()}
    say("READY")
    local_wall_start = time.time()  # the skewed clock: what the gateway believes
    real_start = clockskew.real_monotonic()
    while not gw.out_of_time():
        identity = rng.choice(idents)
        lease = leases[identity]
        roll = rng.random()
        if lease is None or roll < 0.08:
            # (Re)gain: acquire when no row, else take over (refused while active: the
            # policy does not preempt, and the oracle knows whether it was active).
            if epochs[identity] == 0:
                result = gw.acquire(identity, ttl=ttl)
            else:
                result = gw.takeover(identity, ttl=ttl, expected_epoch=epochs[identity])
            if result is not None and result.ok and result.lease is not None:
                leases[identity] = result.lease
                epochs[identity] = result.lease.epoch
        elif roll < 0.12:
            gw.acquire(identity, ttl=ttl)  # lease_held or takeover_required: time decides
        elif roll < 0.35:
            beat = gw.heartbeat(lease, ttl=ttl)
            if beat is not None and beat.ok and beat.lease is not None:
                leases[identity] = beat.lease
        elif roll < 0.38:
            gw.release(lease)
        elif roll < 0.6:
            granted = gw.issue_grant(lease, ttl=grant_ttl)
            if granted is not None and granted.grant is not None:
                grants[identity].append(granted.grant)
        else:
            for grant in list(grants[identity]):
                gw.validate(grant)
        # Pauses of random length make expiries fall on both sides of operations.
        time.sleep(rng.choice([0.0, 0.0, 0.005, 0.02, 0.06, 0.2, 0.4]))
    gw.summary(patched_datetimes=patched, observed=observed,
               rate_observed=(time.time() - local_wall_start)
               / max(1e-9, clockskew.real_monotonic() - real_start))
    gw.close()


def role_smuggle(cfg: Config) -> None:
    """Scenario 10: another gateway process is handed every byte of grants minted elsewhere
    and presents rebuilt copies; every one must be refused."""
    gw = Gateway(cfg)
    accepted = 0
    tried = 0
    for fields in read_dump(str(cfg["dump"])):
        tried += 1
        result = gw.validate(replica(fields), tag="replay")
        accepted += bool(result is not None and result.ok)
    gw.summary(tried=tried, accepted=accepted)
    gw.close()


ROLES: dict[str, Callable[[Config], None]] = {
    "race": role_race, "storm": role_storm, "holder": role_holder, "victim": role_victim,
    "load": role_load, "skew": role_skew, "smuggle": role_smuggle,
}


@contextlib.contextmanager
def _quiet_library_logs() -> Iterator[None]:
    # Refusals are logged at INFO by the library; thousands of them would only fill the
    # worker's stderr file. Warnings still reach it.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    yield


def main(argv: list[str]) -> None:
    role, config_path = argv[1], argv[2]
    cfg = json.loads(Path(config_path).read_text("utf-8"))
    with _quiet_library_logs():
        ROLES[role](cfg)


if __name__ == "__main__":
    main(sys.argv)
