"""Scenario 16: hostile network -> calls bounded, no adapter on a late reply, writes reconciled.

A proxy between a gateway's store and PostgreSQL (:class:`~tests.faults.support.
HostileProxy`) turns hostile at a seeded random moment of each entry point's conversation
(the n-th message the client sends, just before it is forwarded or just after): it goes
silent, delays replies below or above the validity that remains, closes only the client's
side or only the server's, or closes in a reordered way (the server's side closes while a
reply is held back, which then still reaches the client; the close reaches the server before
a pending request; a request is held until its client gave up, then delivered). The entry
points: the store's ``load``, ``validate``, ``invoke`` (with a recording adapter),
``heartbeat``, ``acquire``, ``takeover``, ``release``, ``issue_grant``, ``heartbeat_many``
and ``reconcile`` (of a write lost just before), each on sync and asyncio stores. Judged:

* every entry point returns or raises within the bound documented by ``ConnectionSettings``:
  the call bound for each store call it makes, plus the connect bound for each session it
  had to open, plus a scheduling allowance (``ALLOWANCE``);
* no adapter runs (no context is handed out) on a reply that arrived after the validity it
  reported (expiry minus database now) had run out, measured on the monotonic clock around
  the store's read;
* every write that raised ``CommitOutcomeUnknown`` is reconciled by the public
  ``reconcile`` on fresh store instances, twice: through the healed proxy at once, while
  its request may still be held in the network (the store remembers the lost backend and
  must end it before it looks), and straight to the server once the network delivered
  everything (a server it does not remember, so it relies on in-flight transactions, whose
  documented bound excludes requests still in the network). Both answers must be what the
  database finally holds (lease row and audit log, read from an admin connection once every
  held request was delivered); every write the coordinator reconciled itself reports that
  outcome; every attempt has exactly its one audit row (none if it never committed);
* the history checker finds nothing over every operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    CommitOutcomeUnknown,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    InvocationResult,
    LeaseHandle,
    LeaseIdentity,
    LeaseResult,
    StoreUnavailable,
    ValidationResult,
)
from mos_lease.records import Snapshot
from mos_lease_pg import AsyncPostgresLeaseStore, ConnectionSettings, PostgresLeaseStore
from tests.faults.history import Op, check_history
from tests.faults.recorder import Recorder
from tests.faults.support import (
    HostileFault,
    HostileProxy,
    Table,
    audit_rows,
    db_now,
    final_rows,
    run_prefix,
    scaled,
)

pytestmark = [pytest.mark.faults, pytest.mark.pg]

SETTINGS = ConnectionSettings(statement_timeout=timedelta(seconds=0.6),
                              lock_timeout=timedelta(seconds=0.3), connect_timeout=2.0,
                              call_timeout=1.0)
CALL_BOUND = SETTINGS.call_bound()  # 1 s
# Opening a session: connect_timeout, which libpq never makes shorter than 2 s.
CONNECT_BOUND = 2.0
# Scheduling allowance per entry point: the watchdog looks every 20 ms; a session that
# opens after the call's deadline is cut at once, but its cancel request may take its whole
# grace (a quarter of the call bound: 0.25 s); and four schedules, each with its relay
# threads, share two cores with whatever else runs on the machine.
ALLOWANCE = 0.5
PARALLEL = 4
SCOPES = ["tool:run"]
ENTRIES = ("load", "validate", "invoke", "heartbeat", "acquire", "takeover", "release",
           "issue_grant", "heartbeat_many", "reconcile")
FAULTS = ("silent", "delay_below", "delay_above", "cut_client", "cut_server",
          "reply_after_server_close", "close_before_request", "request_after_client_close")
# How many client messages an entry point sends on a healthy network (the strike lands on
# one of them; a later one would miss, and the schedule is then a control). A statement's
# first use on a connection is prepared in a message of its own before it is executed.
MESSAGES = {"load": 1, "validate": 1, "invoke": 1, "takeover": 4, "reconcile": 3}
WRITES = {"heartbeat", "acquire", "takeover", "release", "heartbeat_many"}
PORT_CALLS = ("load", "apply", "renew_many", "record", "event_committed")
# Seconds after which an entry point counts as hung: above every bound a schedule can
# reach (at most four store calls, each of which may open a session).
HANG = 4 * (CALL_BOUND + CONNECT_BOUND) + 2 * ALLOWANCE
MAX_DELAY = 3 * CALL_BOUND
# How long the proxy may hold a request: until its client gives up (at most 10 s, the
# proxy's own limit), then the fault's delay.
SETTLE = 10 + MAX_DELAY + 5


# --- store calls, timed ---------------------------------------------------------------------


@dataclass(frozen=True)
class PortCall:
    """One store call: when it was sent and answered (monotonic), how many sessions it
    opened, and the database time a read reported."""

    name: str
    t0: float
    t1: float
    sessions: int
    now: datetime | None

    @property
    def bound(self) -> float:
        return CALL_BOUND + CONNECT_BOUND * self.sessions


class Timing:
    def __init__(self, proxy: HostileProxy) -> None:
        self.proxy = proxy
        self.calls: list[PortCall] = []

    def begin(self) -> tuple[float, int]:
        return time.monotonic(), self.proxy.sessions

    def end(self, name: str, began: tuple[float, int], result: object) -> None:
        now = result.now if isinstance(result, Snapshot) else None
        self.calls.append(PortCall(name, began[0], time.monotonic(),
                                   self.proxy.sessions - began[1], now))


class TimedStore(PostgresLeaseStore):
    timing: Timing


class AsyncTimedStore(AsyncPostgresLeaseStore):
    timing: Timing


def _timed(name: str) -> Callable[..., Any]:
    def method(self: TimedStore, *args: Any) -> Any:
        began, result = self.timing.begin(), None
        try:
            result = getattr(PostgresLeaseStore, name)(self, *args)
            return result
        finally:
            self.timing.end(name, began, result)
    return method


def _atimed(name: str) -> Callable[..., Any]:
    async def method(self: AsyncTimedStore, *args: Any) -> Any:
        began, result = self.timing.begin(), None
        try:
            result = await getattr(AsyncPostgresLeaseStore, name)(self, *args)
            return result
        finally:
            self.timing.end(name, began, result)
    return method


for _name in PORT_CALLS:
    setattr(TimedStore, _name, _timed(_name))
    setattr(AsyncTimedStore, _name, _atimed(_name))


class Driver:
    """A coordinator on a timed store through the proxy, sync or asyncio; :meth:`run`
    drives one coordinator call either way (the asyncio one on the schedule's own loop)."""

    def __init__(self, flavor: str, proxy: HostileProxy) -> None:
        self.flavor = flavor
        self.timing = Timing(proxy)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.store: TimedStore | AsyncTimedStore
        self.coordinator: Any
        if flavor == "async":
            self.loop = asyncio.new_event_loop()
            self.store = AsyncTimedStore(proxy.dsn, settings=SETTINGS)
            self.coordinator = AsyncConnectorLeaseCoordinator(self.store, AllowAllPolicy())
        else:
            self.store = TimedStore(proxy.dsn, settings=SETTINGS)
            self.coordinator = ConnectorLeaseCoordinator(self.store, AllowAllPolicy())
        self.store.timing = self.timing
        self.ran: list[tuple[float, ConnectorExecutionContext]] = []

    def run(self, call: Callable[[], Any]) -> Any:
        value = call()
        if self.loop is not None:
            return self.loop.run_until_complete(value)
        return value

    def adapter(self) -> Callable[[ConnectorExecutionContext], Any]:
        """The recording adapter: when it ran, and the context it got."""
        def record(ctx: ConnectorExecutionContext) -> str:
            self.ran.append((time.monotonic(), ctx))
            return "done"

        async def arecord(ctx: ConnectorExecutionContext) -> str:
            return record(ctx)
        return arecord if self.loop is not None else record

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if isinstance(self.store, AsyncTimedStore):
                assert self.loop is not None
                self.loop.run_until_complete(self.store.aclose())
            else:
                self.store.close()
        if self.loop is not None:
            self.loop.close()


# --- one schedule ---------------------------------------------------------------------------


@dataclass
class Attempt:
    result: Any = None
    error: BaseException | None = None
    t0: float = 0.0
    t1: float = 0.0


@dataclass
class Report:
    """What one schedule saw."""

    n: int
    entry: str
    fault: str
    flavor: str
    struck: bool = False
    hung: bool = False
    elapsed: float = 0.0
    bound: float = 0.0
    call_lateness: float = float("-inf")
    outcome: str = ""
    adapter_runs: int = 0
    late_accepted: int = 0  # contexts handed out (adapter runs) on a reply past its validity
    late_refused: int = 0
    accepted_with_delay: int = 0
    unknown: int = 0
    reconciled_fresh: list[int] = field(default_factory=lambda: [0, 0])  # proxy, direct
    reconciled_own: int = 0
    problems: list[str] = field(default_factory=list)


LEASE_COLUMNS = "epoch, connector_id, heartbeat_at, released_at"


def lease_row(admin: psycopg.Connection[Any], identity: LeaseIdentity) -> tuple[Any, ...] | None:
    row = admin.execute(
        f"SELECT {LEASE_COLUMNS} FROM mos_lease.logical_agent_connector_leases "
        "WHERE tenant_id = %s AND logical_agent_id = %s AND binding_id = %s",
        (identity.tenant_id, identity.logical_agent_id, identity.binding_id)).fetchone()
    return None if row is None else tuple(row)


def committed(op: str, before: tuple[Any, ...] | None, after: tuple[Any, ...] | None) -> bool:
    """Whether the lease row shows this schedule's write (one writer per identity)."""
    if op == "acquire":
        return before is None and after is not None
    assert before is not None and after is not None
    if op == "takeover":
        return bool(after[0] == before[0] + 1 and after[1] == "c2")
    if op == "release":
        return before[3] is None and after[3] is not None
    return bool(after[2] > before[2])  # heartbeat: the renewal moved heartbeat_at


def audit_of(admin: psycopg.Connection[Any], correlation_id: str,
             identity: LeaseIdentity) -> list[tuple[str, str, str | None]]:
    rows = admin.execute(
        "SELECT event_id::text, outcome, reason FROM mos_lease.connector_lease_audit_log "
        "WHERE correlation_id = %s AND tenant_id = %s AND logical_agent_id = %s "
        "AND binding_id = %s", (correlation_id, identity.tenant_id, identity.logical_agent_id,
                                identity.binding_id)).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def event_rows(admin: psycopg.Connection[Any], event_id: UUID) -> int:
    row = admin.execute("SELECT count(*) FROM mos_lease.connector_lease_audit_log "
                        "WHERE event_id = %s", (event_id,)).fetchone()
    assert row is not None
    return int(row[0])


class Schedule:
    def __init__(self, n: int, rng: random.Random, prefix: str, dsn: str,
                 admin: psycopg.Connection[Any], recorder: Recorder) -> None:
        self.n = n
        self.entry = ENTRIES[n % len(ENTRIES)]
        self.fault = FAULTS[(n // len(ENTRIES)) % len(FAULTS)]
        # Sync and asyncio alternate along entry points, faults and rounds, so that every
        # entry point meets both flavours in the short run too.
        rounds = n // (len(ENTRIES) * len(FAULTS))
        self.flavor = "async" if (n + n // len(ENTRIES) + rounds) % 2 else "sync"
        self.at = rng.randint(1, MESSAGES.get(self.entry, 2))
        self.after = rng.random() < 0.5
        self.scale = rng.random()  # where in its range the delay falls
        self.lease_ttl = rng.uniform(0.5, 1.5)
        # Short enough that a reply delayed past it still arrives within the call bound
        # (the watchdog cuts a call a grace of 0.25 s before its 1 s bound).
        self.grant_ttl = rng.uniform(0.2, 0.45)
        # A partition: from the strike until healed, new connections are refused too, so
        # the coordinator cannot reconcile by itself and the caller gets the doubt. A
        # request held until its client gave up is always such a partition.
        self.refuse = rng.random() < 0.5 or self.fault == "request_after_client_close"
        # How long the lost renewal stays in the network after its client gave up: often
        # past the reconcile under test (at most three store calls, 3 s) and the fresh one.
        self.hold = rng.uniform(0.3, 3.5)
        if self.entry == "reconcile":
            # The lost renewal must still find its lease active when it is delivered.
            self.lease_ttl = self.hold + 5.0
        self.prefix, self.dsn, self.admin, self.recorder = prefix, dsn, admin, recorder
        count = 3 if self.entry == "heartbeat_many" else 1
        self.idents = [LeaseIdentity(prefix, f"s{n}", f"b{i}") for i in range(count)]
        self.report = Report(n, self.entry, self.fault, self.flavor)
        self.lost_before: tuple[Any, ...] | None = None

    def corr(self, tag: str) -> str:
        return f"s16-{self.n}-{tag}"

    # The operations, each recorded for the history checker.

    def _recorded(self, driver: Driver, op: Op, identity: LeaseIdentity, connector: str,
                  tag: str, call: Callable[[str], Callable[[], Any]], attempt: Attempt, *,
                  audit_key: str | None = None, epoch: int | None = None,
                  args: dict[str, Any] | None = None) -> Any:
        correlation = self.corr(tag)

        def fn() -> Any:
            attempt.t0 = time.monotonic()
            try:
                attempt.result = driver.run(call(correlation))
                return attempt.result
            except BaseException as failure:
                attempt.error = failure
                raise
            finally:
                attempt.t1 = time.monotonic()
        result, _ = self.recorder.call(op, identity, connector, correlation, fn,
                                       audit_key=audit_key, presented_epoch=epoch, args=args)
        return result

    def _acquire(self, driver: Driver, identity: LeaseIdentity, tag: str,
                 attempt: Attempt | None = None) -> LeaseResult:
        got: LeaseResult = self._recorded(
            driver, Op.ACQUIRE, identity, "c1", tag,
            lambda c: lambda: driver.coordinator.acquire(identity, "c1", scopes=SCOPES,
                                                         ttl=self.lease_ttl, correlation_id=c),
            attempt or Attempt())
        return got

    def run(self) -> Report:
        proxy = HostileProxy(self.dsn)
        driver = Driver(self.flavor, proxy)
        try:
            self._run(proxy, driver)
        finally:
            driver.close()
            proxy.close()
        return self.report

    def _setup(self, proxy: HostileProxy, driver: Driver
               ) -> tuple[list[LeaseHandle], ExecutionGrant | None, UUID | None]:
        """On a healthy network: the leases, the grant, the lost write the entry needs."""
        leases: list[LeaseHandle] = []
        if self.entry != "acquire":
            for i, identity in enumerate(self.idents):
                got = self._acquire(driver, identity, f"setup{i}")
                assert got.lease is not None, got
                leases.append(got.lease)
        else:
            driver.run(driver.store.now)  # connected before the entry point is called
        grant: ExecutionGrant | None = None
        if self.entry in ("validate", "invoke"):
            grant = self._issue(driver, leases[0], "setupgrant", self.grant_ttl, Attempt())
            assert grant is not None
        lost: UUID | None = None
        if self.entry == "reconcile":
            self.lost_before = lease_row(self.admin, self.idents[0])
            lost = self._lose_heartbeat(proxy, driver, leases[0])
        return leases, grant, lost

    def _delay(self, expiry: datetime | None) -> float:
        """The fault's delay, from the validity left (grant or lease) at this moment; never
        much past the call bound, beyond which every delay looks the same to the store."""
        left = (max(0.05, (expiry - db_now(self.admin)).total_seconds())
                if expiry is not None else self.lease_ttl)
        left = min(left, MAX_DELAY / 1.2)
        if self.fault == "delay_below":
            return (0.1 + 0.4 * self.scale) * left
        if self.fault == "delay_above":
            return left + 0.05 + 0.15 * self.scale
        # A reordered close holds its reply or request on either side of the validity.
        return 1.2 * self.scale * left

    def _run(self, proxy: HostileProxy, driver: Driver) -> None:
        report = self.report
        leases, grant, lost = self._setup(proxy, driver)
        if self.entry == "reconcile" and lost is None:
            return
        before = {i: lease_row(self.admin, i) for i in self.idents}
        delay = self._delay(grant.expires_at if grant is not None else
                            leases[0].expires_at if leases else None)
        fault = HostileFault.DELAY if self.fault.startswith("delay") else HostileFault(self.fault)
        mark = len(driver.timing.calls)
        proxy.arm(fault, at=self.at, after=self.after, delay=delay,
                  then_refuse=self.refuse and fault not in (HostileFault.SILENT,
                                                            HostileFault.DELAY))
        # A call that never returns (no client-side bound) is woken by closing every socket
        # of the proxy, so that the run goes on and reports it.
        fired = threading.Event()

        def wake() -> None:
            fired.set()
            proxy.close()
        hang = threading.Timer(HANG, wake)
        hang.start()
        attempt = Attempt()
        try:
            self._entry(driver, leases, grant, lost, attempt)
        finally:
            hang.cancel()
        report.hung = fired.is_set()
        report.struck = proxy.struck
        proxy.heal()
        unknown: list[UUID] = []
        if isinstance(attempt.error, CommitOutcomeUnknown) and self.entry in WRITES:
            unknown.append(attempt.error.event_id)
        if lost is not None:
            unknown.append(lost)
        # Each write in doubt is reconciled twice, on fresh store instances. Through the
        # healed proxy at once, while a request may still be held in the network: the
        # store remembers the lost backend and must end it before it looks. Then straight
        # to the server, which it does not remember (another server as far as it can
        # tell), once the network delivered everything, as that path's documented bound
        # asks. Both answers must be what the database finally holds.
        answers = [self._reconcile(proxy, unknown, via_proxy=True)]
        if not proxy.settle(SETTLE):
            report.problems.append("a held request was never delivered")
        time.sleep(0.05)  # a request just delivered: let the server read it
        answers.append(self._reconcile(proxy, unknown, via_proxy=False))
        self._judge_time(driver.timing.calls[mark:], attempt)
        self._judge_validity(driver, driver.timing.calls[mark:], attempt, delay)
        report.unknown = len(unknown)
        after = {i: lease_row(self.admin, i) for i in self.idents}
        self._judge_writes(before, after, attempt, lost)
        for given in answers:
            self._judge_answers(before, after, lost, given)

    def _issue(self, driver: Driver, lease: LeaseHandle, tag: str, ttl: float,
               attempt: Attempt) -> ExecutionGrant | None:
        issued = self._recorded(
            driver, Op.ISSUE_GRANT, lease.identity, "c1", tag,
            lambda c: lambda: driver.coordinator.issue_grant(lease, scopes=SCOPES, ttl=ttl,
                                                             correlation_id=c),
            attempt, epoch=lease.epoch)
        return None if issued is None else issued.grant

    def _lose_heartbeat(self, proxy: HostileProxy, driver: Driver,
                        lease: LeaseHandle) -> UUID | None:
        """A renewal lost in the network: its execution (the second message: the first
        prepares the statement) is held until its client gave up, and delivered a little
        later, while the reconcile under test may be looking; the store's own reconcile was
        refused a connection, so the caller holds the doubt."""
        proxy.arm(HostileFault.REQUEST_AFTER_CLIENT_CLOSE, at=2, delay=self.hold,
                  then_refuse=True)
        attempt = Attempt()
        self._recorded(driver, Op.HEARTBEAT, lease.identity, "c1", "lost",
                       lambda c: lambda: driver.coordinator.heartbeat(lease, ttl=2,
                                                                      correlation_id=c),
                       attempt, epoch=lease.epoch, args={"lease_id": str(lease.lease_id)})
        proxy.heal()
        if not isinstance(attempt.error, CommitOutcomeUnknown):
            # Only a store without a client-side bound gets here: its call waited for the
            # held request's reply instead of giving up.
            self.report.problems.append(
                f"the renewal lost in the network took {attempt.t1 - attempt.t0:.1f} s and "
                f"ended in {attempt.error or attempt.result!r}, not in doubt")
            return None
        return attempt.error.event_id

    def _entry(self, driver: Driver, leases: list[LeaseHandle], grant: ExecutionGrant | None,
               lost: UUID | None, attempt: Attempt) -> None:
        coordinator, entry = driver.coordinator, self.entry
        lease = leases[0] if leases else None
        identity = self.idents[0]
        if entry in ("load", "reconcile"):
            attempt.t0 = time.monotonic()
            try:
                attempt.result = driver.run(
                    (lambda: driver.store.load(identity)) if entry == "load"
                    else (lambda: coordinator.reconcile(identity, lost)))
            except Exception as failure:
                attempt.error = failure
            attempt.t1 = time.monotonic()
            return
        if entry in ("validate", "invoke"):
            assert grant is not None
            adapter = driver.adapter()
            self._recorded(
                driver, Op.VALIDATE, identity, "c1", "entry",
                lambda c: (lambda: coordinator.validate(grant, identity=identity, scopes=SCOPES,
                                                        correlation_id=c))
                if entry == "validate" else
                (lambda: coordinator.invoke(grant, adapter, identity=identity, scopes=SCOPES,
                                            correlation_id=c)),
                attempt, audit_key=grant.correlation_id, epoch=grant.epoch,
                args={"grant_id": str(grant.grant_id)})
            return
        if entry == "acquire":
            self._acquire(driver, identity, "entry", attempt)
            return
        assert lease is not None
        if entry == "issue_grant":
            self._issue(driver, lease, "entry", 1.0, attempt)
            return
        if entry == "heartbeat_many":
            correlation = self.corr("entry")

            def batch() -> list[LeaseResult]:
                attempt.t0 = time.monotonic()
                try:
                    attempt.result = driver.run(lambda: coordinator.heartbeat_many(
                        leases, ttl=2, correlation_id=correlation))
                    return attempt.result  # type: ignore[no-any-return]
                except BaseException as failure:
                    attempt.error = failure
                    raise
                finally:
                    attempt.t1 = time.monotonic()
            self.recorder.call_batch(
                Op.HEARTBEAT, [(h.identity, "c1", h.epoch, {"lease_id": str(h.lease_id)})
                               for h in leases], correlation, batch)
            return
        op, connector, call = {
            "heartbeat": (Op.HEARTBEAT, "c1", lambda c: lambda: coordinator.heartbeat(
                lease, ttl=2, correlation_id=c)),
            "release": (Op.RELEASE, "c1", lambda c: lambda: coordinator.release(
                lease, correlation_id=c)),
            "takeover": (Op.TAKEOVER, "c2", lambda c: lambda: coordinator.takeover(
                identity, "c2", scopes=SCOPES, ttl=2, expected_epoch=lease.epoch,
                correlation_id=c)),
        }[entry]
        self._recorded(driver, op, identity, connector, "entry", call, attempt,
                       epoch=lease.epoch, args={"lease_id": str(lease.lease_id)})

    # The judgements.

    def _judge_time(self, calls: Sequence[PortCall], attempt: Attempt) -> None:
        report = self.report
        report.elapsed = attempt.t1 - attempt.t0
        report.bound = sum(c.bound for c in calls) + ALLOWANCE
        report.call_lateness = max((c.t1 - c.t0 - c.bound for c in calls), default=0.0)
        error = attempt.error
        report.outcome = (type(error).__name__ if error is not None else
                          type(attempt.result).__name__)
        if error is not None and not isinstance(error, StoreUnavailable | CommitOutcomeUnknown):
            report.problems.append(f"raised {type(error).__name__}: {error}")
        if report.elapsed > report.bound:
            report.problems.append(f"took {report.elapsed:.3f} s, bound {report.bound:.3f} s "
                                   f"({len(calls)} store calls)")

    def _judge_validity(self, driver: Driver, calls: Sequence[PortCall], attempt: Attempt,
                        delay: float) -> None:
        if self.entry not in ("validate", "invoke"):
            return
        report, result = self.report, attempt.result
        reads = [c for c in calls if c.name == "load" and c.now is not None]
        report.adapter_runs = len(driver.ran)
        context = result.context if isinstance(result, ValidationResult | InvocationResult) \
            else None
        if context is None or not reads:
            if isinstance(result, ValidationResult | InvocationResult) and str(result.reason) \
                    in ("grant_expired", "lease_expired") and self.fault.startswith("delay"):
                report.late_refused += 1
            return
        read = reads[0]
        assert read.now is not None
        validity = (context.expires_at - read.now).total_seconds()
        in_flight = read.t1 - read.t0
        if in_flight >= validity:
            report.late_accepted += 1
            report.problems.append(
                f"{'adapter ran' if self.entry == 'invoke' else 'context handed out'} on a "
                f"reply {in_flight:.3f} s in flight, validity {validity:.3f} s")
        elif proxy_delayed(self.fault) and in_flight >= delay > 0:
            report.accepted_with_delay += 1
        if self.entry == "invoke" and (len(driver.ran) != 1 or driver.ran[0][1] != context):
            report.problems.append("the adapter did not get the context once")

    def _reconcile(self, proxy: HostileProxy, unknown: list[UUID], *,
                   via_proxy: bool) -> dict[UUID, bool]:
        answers: dict[UUID, bool] = {}
        if via_proxy and proxy.closed:
            return answers  # a hung call was woken by closing the proxy
        for event_id in unknown:
            try:
                answers[event_id] = self._fresh_reconcile(proxy, event_id, via_proxy)
                self.report.reconciled_fresh[0 if via_proxy else 1] += 1
            except Exception as failure:
                self.report.problems.append(f"fresh reconcile of {event_id} failed: "
                                            f"{failure!r}")
        return answers

    def _judge_writes(self, before: dict[LeaseIdentity, Any], after: dict[LeaseIdentity, Any],
                      attempt: Attempt, lost: UUID | None) -> None:
        """What the caller was told, and the audit rows, against the final lease rows."""
        report, admin = self.report, self.admin
        if lost is not None:
            held = committed("heartbeat", self.lost_before, after[self.idents[0]])
            if len(audit_of(admin, self.corr("lost"), self.idents[0])) > 1:
                report.problems.append("lost write: more than one audit row for one attempt")
            if isinstance(attempt.result, bool) and attempt.result != held:
                report.problems.append(f"reconcile answered {attempt.result}, the database "
                                       f"holds committed={held}")
        if self.entry not in WRITES:
            return
        results: list[Any] = (attempt.result if isinstance(attempt.result, list)
                              else [attempt.result] * len(self.idents))
        for identity, result in zip(self.idents, results, strict=True):
            held = committed(self.entry, before[identity], after[identity])
            rows = audit_of(admin, self.corr("entry"), identity)
            successes = [r for r in rows if r[1] != "denied"]
            if len(rows) > 1 or len(successes) != int(held):
                report.problems.append(f"{identity.binding_id}: audit rows {rows} for a write "
                                       f"that committed={held}")
            if isinstance(result, LeaseResult):
                if result.reconciled:
                    report.reconciled_own += 1
                if result.ok != held:
                    report.problems.append(f"{identity.binding_id}: told ok={result.ok} "
                                           f"(reconciled={result.reconciled}), the database "
                                           f"holds committed={held}")
                if not rows:
                    report.problems.append(f"{identity.binding_id}: no audit row for a "
                                           f"{result.outcome} attempt")

    def _judge_answers(self, before: dict[LeaseIdentity, Any], after: dict[LeaseIdentity, Any],
                       lost: UUID | None, answers: dict[UUID, bool]) -> None:
        """A fresh reconcile's answers against the audit log and the final lease rows."""
        for event_id, answer in answers.items():
            rows = event_rows(self.admin, event_id)
            if event_id == lost:
                held = committed("heartbeat", self.lost_before, after[self.idents[0]])
            else:
                # A batch's writes share one doubt: the event's own identity is not known.
                held = answer if self.entry == "heartbeat_many" else committed(
                    self.entry, before[self.idents[0]], after[self.idents[0]])
            if answer != held or rows != int(answer):
                self.report.problems.append(
                    f"reconcile of {'the lost write' if event_id == lost else 'the entry'} "
                    f"said {answer}: the lease row says committed={held}, {rows} audit rows")

    def _fresh_reconcile(self, proxy: HostileProxy, event_id: UUID, via_proxy: bool) -> bool:
        """The public reconcile on a new store instance: through the healed proxy (the same
        server as far as the store can tell, so a remembered backend is ended first) or
        straight to the server (then reconcile waits for in-flight transactions)."""
        with PostgresLeaseStore(proxy.dsn if via_proxy else self.dsn,
                                settings=SETTINGS) as store:
            answer: bool = ConnectorLeaseCoordinator(store, AllowAllPolicy()).reconcile(
                self.idents[0], event_id)
            return answer


def proxy_delayed(fault: str) -> bool:
    return fault.startswith("delay") or fault == "reply_after_server_close"


# --- the run --------------------------------------------------------------------------------


def test_hostile_network(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                         figures: Table, tmp_path: Path) -> None:
    count = scaled(soak, len(ENTRIES) * len(FAULTS), 4 * len(ENTRIES) * len(FAULTS))
    prefix = run_prefix("s16")
    rng = random.Random(16)
    recorder = Recorder(tmp_path / "s16.jsonl", "s16", pg_dsn)
    schedules = [Schedule(n, rng, prefix, pg_dsn, admin, recorder) for n in range(count)]
    began = time.monotonic()
    try:
        with ThreadPoolExecutor(PARALLEL) as pool:
            reports = list(pool.map(Schedule.run, schedules))
    finally:
        recorder.close()
    wall = time.monotonic() - began
    audit = audit_rows(admin, prefix)
    violations = check_history(recorder.records, audit, final_rows=final_rows(admin, prefix))

    struck = [r for r in reports if r.struck]
    late = [r for r in reports if r.elapsed > r.bound or r.hung]
    lateness = max(r.elapsed - r.bound + ALLOWANCE for r in reports)
    problems = [f"#{r.n} {r.flavor} {r.entry}/{r.fault}: {p}" for r in reports
                for p in r.problems]
    covered = Counter((r.entry, r.fault) for r in struck)
    figures.counts("randomized schedules", count, len(reports))
    figures.add("schedules where the fault struck during the call", len(struck),
                f">= {len(ENTRIES) * len(FAULTS) * 3 // 4}",
                len(struck) >= len(ENTRIES) * len(FAULTS) * 3 // 4)
    figures.add("entry point x fault pairs struck (sync, async)",
                f"{len(covered)} of {len(ENTRIES) * len(FAULTS)} "
                f"({sum(1 for r in struck if r.flavor == 'sync')}, "
                f"{sum(1 for r in struck if r.flavor == 'async')})")
    figures.add("entry points past their bound (or hung)", len(late), "0", not late)
    figures.add("max lateness over the call bounds (s; < 0 is early)",
                round(lateness, 3), f"<= {ALLOWANCE}", lateness <= ALLOWANCE)
    figures.add("max store call over its own bound (s)",
                round(max(r.call_lateness for r in reports), 3), "", None)
    figures.add("max entry point time (s)", round(max(r.elapsed for r in reports), 3), "",
                None)
    runs = sum(r.adapter_runs for r in reports)
    late_ok = sum(r.late_accepted for r in reports)
    figures.add("adapter runs / contexts on a reply past its validity", late_ok,
                "0", late_ok == 0)
    figures.add("adapter runs (all) / accepted under a delay below the validity",
                f"{runs} / {sum(r.accepted_with_delay for r in reports)}", "> 0 / > 0",
                runs > 0 and sum(r.accepted_with_delay for r in reports) > 0)
    figures.add("validations refused because the delayed reply came too late",
                sum(r.late_refused for r in reports), "> 0",
                sum(r.late_refused for r in reports) > 0)
    unknown = sum(r.unknown for r in reports)
    proxied = sum(r.reconciled_fresh[0] for r in reports)
    direct = sum(r.reconciled_fresh[1] for r in reports)
    figures.add("CommitOutcomeUnknown raised / reconciled on a fresh store (through the "
                "healed proxy at once, straight to the server once settled)",
                f"{unknown} / {proxied}, {direct}", "all, all",
                unknown == proxied == direct and unknown > 0)
    figures.add("writes the coordinator reconciled itself",
                sum(r.reconciled_own for r in reports), "", None)
    figures.add("schedule failures (outcome vs database, audit rows, bounds, crashes)",
                len(problems), "0", not problems)
    figures.add("history checker violations", len(violations), "0", not violations)
    figures.add("operations recorded / audit rows checked", f"{len(recorder.records)} / "
                f"{len(audit)}", "", None)
    figures.add("outcomes", dict(Counter(r.outcome for r in reports)), "", None)
    figures.notes.append(f"wall time of the schedules: {wall:.1f} s, {PARALLEL} at a time")
    for text in problems[:12] + [str(v) for v in violations[:8]]:
        figures.notes.append(text)
    assert not figures.failed(), figures.render()
