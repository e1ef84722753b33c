"""Scenario 21: notice flood -> 0 holdings lost; renewals, validations and confirming reads
within their bounds.

Any login may ``NOTIFY`` on any channel. One gateway serves eight bindings through one
listener (``LeaseNotices``) and the one notice confirmer its holders share: a thread holder,
an asyncio holder, a thread waiter and an asyncio waiter, each once renewing through its own
coordinator and once through a separate heartbeat coordinator (``heartbeat_coordinator=``,
a connection of its own). Holders hold 5 s leases (local deadline 4.5 s) and validate
their grants without pause; waiters wait behind a rival's lease with 10 s pauses.

A login with no privilege at all (``LOGIN`` and nothing else) then sends well-formed
takeover notices of newer epochs for all eight identities at full speed: statements of
50,000 distinct notices each, back to back, the sender keeping one statement ahead of what
the listener has taken in (so the listener is never idle and no backlog is left in the
server's notice queue, which every database of the cluster shares). After the flood, each
waiter's rival releases its lease: that real notice must still wake the waiter at once.

Required: no holding lost, every renewal within the store's call bound and no gap between
renewals reaching the local deadline, every validation accepted within the call bound,
confirming turns within the confirmer's bound (``burst + rate * seconds``), the flood
visible (turns held back, one WARNING), and the waiters woken by the real releases. Only
``LeaseNotices``, ``hold`` and the public ``confirmer`` attribute are used, so the same file
shows the hole on the code before notices were bounded (which ignores ``confirmer``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import attrs
import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseHandle,
    LeaseIdentity,
    LeaseLoss,
    hold,
)
from mos_lease.events import RenewalRetry, Renewed
from mos_lease.holder import HoldCallbacks, HoldTiming
from mos_lease.keeper import KeeperTiming
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.notice_gate import NoticeStats
from mos_lease_pg import AsyncPostgresLeaseStore, LeaseNotices, PostgresLeaseStore
from tests.faults.support import Table, run_prefix, scaled
from tests.notice_flood import Heard, count_loads, send_flood, turn_bound, unprivileged_login

pytestmark = [pytest.mark.faults, pytest.mark.pg]

SCOPES = ["tool:run"]
TTL = 5.0
BATCH = 50_000  # notices per statement: what one unprivileged statement sends in ~0.1 s
ABOVE = 1_000  # forged epochs start above this, far above any real one here
WAKE = 1.0  # seconds: a real release wakes a waiter "at once" (its pause is 10 s)
RIVAL_TTL = 120  # the waiters' rival outlasts any run, the slowest listener's included


@dataclass
class Subject:
    """One binding of the gateway: a holder or a waiter, thread or asyncio."""

    name: str
    identity: LeaseIdentity
    kind: str  # "thread" or "asyncio"
    role: str  # "holder" or "waiter"
    separate_heartbeats: bool
    loads: list[int] = field(default_factory=lambda: [0])
    renewals: list[tuple[float, float]] = field(default_factory=list)  # (at, duration)
    retries: int = 0
    validations: list[float] = field(default_factory=list)
    grants: int = 0
    refused: list[str] = field(default_factory=list)
    lost: LeaseLoss | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    acquired_at: float | None = None
    error: str | None = None

    def on_event(self, event: object) -> None:
        if isinstance(event, Renewed):
            self.renewals.append((time.monotonic(), event.duration))
        elif isinstance(event, RenewalRetry):
            self.retries += 1

    def acquired(self, _lease: object) -> None:
        self.acquired_at = time.monotonic()
        self.ready.set()


class Gateway:
    """The gateway process under attack: eight subjects, one listener, one confirmer."""

    def __init__(self, dsn: str, prefix: str, notices: LeaseNotices) -> None:
        self.dsn = dsn
        self.notices = notices
        self.stop = threading.Event()
        self.subjects = [
            Subject(f"{kind} {role}{' +hb' if separate else ''}",
                    LeaseIdentity(prefix, f"{kind}-{role}", "hb" if separate else "own"),
                    kind, role, separate)
            for kind in ("thread", "asyncio") for role in ("holder", "waiter")
            for separate in (False, True)]
        self.rival_store = PostgresLeaseStore(dsn)
        self.rival = ConnectorLeaseCoordinator(self.rival_store, AllowAllPolicy())
        self.rival_leases: dict[str, LeaseHandle] = {}
        for subject in self.of("waiter"):
            lease = self.rival.acquire(subject.identity, "rival", scopes=SCOPES,
                                       ttl=RIVAL_TTL).lease
            assert lease is not None
            self.rival_leases[subject.name] = lease
        self.stores: list[PostgresLeaseStore] = []
        self.threads: list[threading.Thread] = []

    def of(self, role: str) -> list[Subject]:
        return [s for s in self.subjects if s.role == role]

    def _options(self, subject: Subject) -> dict[str, Any]:
        told = HoldCallbacks(on_event=subject.on_event,
                             on_lost=lambda loss: setattr(subject, "lost", loss),
                             on_started=subject.acquired)
        options: dict[str, Any] = {"scopes": SCOPES, "notices": self.notices}
        if subject.role == "holder":
            return {**options, "ttl": TTL, "timing": HoldTiming(clock_step=0),
                    "callbacks": told}
        return {**options, "ttl": 30, "wait": RIVAL_TTL,
                "timing": HoldTiming(clock_step=0, min_backoff=10, max_backoff=10),
                "callbacks": attrs.evolve(told, on_new_holder=lambda *_: subject.ready.set())}

    # -- thread subjects ---------------------------------------------------------------------

    def _thread_subject(self, subject: Subject) -> None:
        store = PostgresLeaseStore(self.dsn)
        self.stores.append(store)
        subject.loads = count_loads(store)
        coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        heartbeats = None
        if subject.separate_heartbeats:
            hb_store = PostgresLeaseStore(self.dsn)
            self.stores.append(hb_store)
            heartbeats = ConnectorLeaseCoordinator(hb_store, AllowAllPolicy())
        try:
            with hold(coordinator, subject.identity, "gateway",
                      heartbeat_coordinator=heartbeats, **self._options(subject)) as held:
                while not self.stop.is_set() and subject.role == "holder":
                    granted = held.issue_grant(scopes=SCOPES, ttl=10)
                    subject.grants += 1
                    grant = granted.grant
                    assert grant is not None, granted.reason
                    until = time.monotonic() + 1.0
                    while time.monotonic() < until and not self.stop.is_set():
                        began = time.monotonic()
                        result = coordinator.validate(grant, identity=subject.identity,
                                                      scopes=SCOPES)
                        subject.validations.append(time.monotonic() - began)
                        if not result.ok:
                            subject.refused.append(str(result.reason))
                            break
        except Exception as failed:  # recorded and judged as a figure
            subject.error = f"{type(failed).__name__}: {failed}"
            subject.ready.set()

    # -- asyncio subjects, all on one loop -----------------------------------------------------

    async def _async_subject(self, subject: Subject) -> None:
        store = AsyncPostgresLeaseStore(self.dsn)
        subject.loads = count_loads(store)
        coordinator = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
        hb_store = AsyncPostgresLeaseStore(self.dsn) if subject.separate_heartbeats else None
        heartbeats = None if hb_store is None else AsyncConnectorLeaseCoordinator(
            hb_store, AllowAllPolicy())
        try:
            async with hold(coordinator, subject.identity, "gateway",
                            heartbeat_coordinator=heartbeats, **self._options(subject)) as held:
                while not self.stop.is_set() and subject.role == "holder":
                    granted = await held.issue_grant(scopes=SCOPES, ttl=10)
                    subject.grants += 1
                    grant = granted.grant
                    assert grant is not None, granted.reason
                    until = time.monotonic() + 1.0
                    while time.monotonic() < until and not self.stop.is_set():
                        began = time.monotonic()
                        result = await coordinator.validate(grant, identity=subject.identity,
                                                            scopes=SCOPES)
                        subject.validations.append(time.monotonic() - began)
                        if not result.ok:
                            subject.refused.append(str(result.reason))
                            break
                        await asyncio.sleep(0)  # other bindings on the loop get their turn
                if subject.role == "holder":
                    return
        except Exception as failed:
            subject.error = f"{type(failed).__name__}: {failed}"
            subject.ready.set()
        finally:
            await store.aclose()
            if hb_store is not None:
                await hb_store.aclose()

    async def _loop(self) -> None:
        await asyncio.gather(*(self._async_subject(s) for s in self.subjects
                               if s.kind == "asyncio"))

    def start(self) -> None:
        for subject in self.subjects:
            if subject.kind == "thread":
                self.threads.append(threading.Thread(target=self._thread_subject,
                                                     args=(subject,), daemon=True))
        self.threads.append(threading.Thread(target=asyncio.run, args=(self._loop(),),
                                             daemon=True))
        for thread in self.threads:
            thread.start()
        for subject in self.subjects:
            assert subject.ready.wait(30), f"{subject.name} never started"
            assert subject.error is None, subject.error

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
        for store in self.stores:
            store.close()
        self.rival_store.close()


def flood(forger: str, gateway: Gateway, heard: Heard, seconds: float) -> tuple[int, int, float]:
    """Full speed for ``seconds``: a statement of ``BATCH`` notices as soon as the listener
    has taken in all but the last one sent; (notices sent, statements, seconds taken)."""
    identities = [s.identity for s in gateway.subjects]
    each = BATCH // len(identities)
    sent = statements = 0
    began = time.monotonic()
    with psycopg.connect(forger, autocommit=True) as conn:
        while time.monotonic() - began < seconds:
            while heard.count < sent - each * len(identities) \
                    and time.monotonic() - began < seconds:
                time.sleep(0.002)  # the listener is a whole statement behind
            send_flood(forger, gateway.notices.channel, identities, each, ABOVE + sent,
                       conn=conn)
            sent += each * len(identities)
            statements += 1
    return sent, statements, time.monotonic() - began


def gaps(times: list[float], began: float, ended: float) -> float:
    """The longest stretch in [began, ended] without a renewal."""
    points = [began, *sorted(t for t in times if began < t < ended), ended]
    return max(b - a for a, b in itertools.pairwise(points))


@dataclass
class Run:
    """What one flood did to the gateway."""

    gateway: Gateway
    confirmer: NoticeConfirmer
    sent: int
    statements: int
    took: float
    heard: int
    began: float
    all_heard: float
    ended: float
    loads: dict[str, int]  # reads other than the holders' validations and grant issues
    stats: NoticeStats  # the confirmer's, once the flood was all heard
    woken: dict[str, float | None]
    warnings: int
    call_bound: float


def attack(pg_dsn: str, admin: psycopg.Connection[Any], seconds: float,
           caplog: pytest.LogCaptureFixture) -> Run:
    confirmer = NoticeConfirmer()
    with LeaseNotices(pg_dsn) as notices:
        notices.confirmer = confirmer  # the gateway's own: its counts are this scenario's
        assert notices.listening.wait(10), notices.refused
        gateway = Gateway(pg_dsn, run_prefix("flood"), notices)
        heard = Heard(notices, *(s.identity for s in gateway.subjects))
        try:
            gateway.start()
            with unprivileged_login(admin, pg_dsn) as forger:
                began = time.monotonic()
                sent, statements, took = flood(forger, gateway, heard, seconds)
                all_heard = heard.wait_for(sent, timeout=20)  # judged as a figure
            ended = time.monotonic()
            heard_count = heard.count
            # A validation and a grant issue read the row once each: what is left is what
            # notices caused (and, for a waiter, its own polls every 10 s). Counted before
            # the turns: every such read follows the start of its turn.
            loads = {s.name: s.loads[0] - len(s.validations) - s.grants
                     for s in gateway.subjects}
            stats = confirmer.stats()
            time.sleep(0.3)  # the turns still queued have run
            released = time.monotonic()
            for subject in gateway.of("waiter"):
                gateway.rival.release(gateway.rival_leases[subject.name])
            woken: dict[str, float | None] = {}
            for subject in gateway.of("waiter"):
                while subject.acquired_at is None and time.monotonic() < released + 5:
                    time.sleep(0.005)
                woken[subject.name] = (None if subject.acquired_at is None
                                       else subject.acquired_at - released)
        finally:
            gateway.close()
    warnings = [r for r in caplog.records
                if r.name == "mos_lease.notices" and r.levelno >= logging.WARNING]
    return Run(gateway, confirmer, sent, statements, took, heard_count, began, all_heard,
               ended, loads, stats, woken, len(warnings), gateway.rival_store.settings.call_bound())


def report(figures: Table, run: Run) -> None:
    gateway, confirmer, stats = run.gateway, run.confirmer, run.stats
    deadline = TTL - KeeperTiming(TTL, clock_step=0).margin
    holders = gateway.of("holder")
    lost = {s.name: str(s.lost.reason) for s in holders if s.lost is not None}
    errors = {s.name: s.error for s in gateway.subjects if s.error is not None}
    calls = [d for s in holders for _, d in s.renewals]
    longest_call = max(calls, default=0.0)
    worst_gap = max(gaps([t for t, _ in s.renewals], run.began, run.ended) for s in holders)
    validations = [v for s in holders for v in s.validations]
    longest_validation = max(validations, default=0.0)
    refused = [r for s in holders for r in s.refused]
    flood_seconds = run.ended - run.began
    turns_allowed = turn_bound(confirmer.rate, confirmer.burst, flood_seconds)
    reads = sum(run.loads.values())
    # A waiter's own polls (every 10 s), and per holder one validation or grant issue
    # whose read was counted before the call was.
    polls = len(gateway.of("waiter")) * int(2 + flood_seconds // 10)
    reads_allowed = stats.confirmations + polls + len(holders)
    renewals_needed = int(flood_seconds // (TTL / 2))
    late = [w for w in run.woken.values() if w is None or w > WAKE]
    figures.add("gateway", f"1 listener, 1 confirmer (burst {confirmer.burst}, "
                f"{confirmer.rate:g}/s); holders ttl {TTL:g} s (local deadline {deadline:g} "
                "s); waiters behind a rival's lease, pauses of 10 s")
    figures.add("subjects", ", ".join(s.name for s in gateway.subjects))
    figures.add("forged notices sent / statements / seconds",
                f"{run.sent:,} / {run.statements} / {run.took:.1f}")
    rate = run.heard / max(run.all_heard - run.began, 1e-9)
    figures.add("notices heard by the listener", f"{run.heard:,} ({rate:,.0f}/s)",
                "all sent", run.heard == run.sent)
    figures.add("holdings lost", len(lost), "0", not lost)
    figures.add("subjects failed", len(errors), "0", not errors)
    figures.add("renewals (retries)",
                f"{len(calls)} ({sum(s.retries for s in holders)})",
                f">= {renewals_needed} each",
                all(len(s.renewals) >= renewals_needed for s in holders))
    figures.add("longest renewal call (s)", longest_call,
                f"<= call bound {run.call_bound:g}", longest_call <= run.call_bound)
    figures.add("longest stretch without a renewal (s)", worst_gap,
                f"< local deadline {deadline:g}", worst_gap < deadline)
    figures.add("validations accepted / refused", f"{len(validations):,} / {len(refused)}",
                "> 0 / 0", bool(validations) and not refused)
    figures.add("longest validation (s)", longest_validation,
                f"<= call bound {run.call_bound:g}", longest_validation <= run.call_bound)
    figures.add("confirming turns", stats.confirmations,
                f"<= {turns_allowed:.0f} (burst + rate x {flood_seconds:.1f} s)",
                stats.confirmations <= turns_allowed)
    figures.add("reads caused by notices (and waiters' polls)", reads,
                f"<= {reads_allowed} (one per turn + {polls} polls + {len(holders)} in flight)",
                reads <= reads_allowed)
    figures.add("notices coalesced / turns held back",
                f"{stats.coalesced:,} / {stats.held_back}", "held back > 0",
                stats.held_back > 0)
    figures.add("WARNING records (mos_lease.notices)", run.warnings, "1", run.warnings == 1)
    figures.add("waiters woken by the real release (s)",
                ", ".join("never" if w is None else f"{w:.2f}" for w in run.woken.values()),
                f"each <= {WAKE:g}", not late)
    figures.notes += [f"lost: {name}: {reason}" for name, reason in lost.items()]
    figures.notes += [f"failed: {name}: {error}" for name, error in errors.items()]
    figures.notes += [f"reads: {name}: {count:,}" for name, count in run.loads.items()]


def test_notice_flood(pg_dsn: str, admin: psycopg.Connection[Any], soak: bool,
                      figures: Table, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mos_lease.notices")
    run = attack(pg_dsn, admin, float(scaled(soak, 8, 40)), caplog)
    report(figures, run)
    assert not figures.failed(), figures.render()
