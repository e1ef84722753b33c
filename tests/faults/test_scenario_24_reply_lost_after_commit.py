"""Scenario 24: a reply lost after its commit -> every write kind told and reconciled truthfully.

Killing backends almost never loses a reply *after* the commit (the kill lands before it far
more often), so this scenario makes that case on purpose: a proxy between the store and
PostgreSQL (:class:`~tests.faults.lostreply.ReplyLossProxy`) forwards one write statement,
lets the server commit it, and closes both sides before any byte of the reply reaches the
client. Each write kind is struck this way, on sync and asyncio stores: acquire, heartbeat,
takeover and release (a guarded write), ``heartbeat_many`` (one batch statement), a grant
issue, and the refusal of each lifecycle operation (the last two append an audit row that
changes no lease). Two modes:

* ``answered``: the network is fine again right after the strike. A guarded write is
  reconciled by the coordinator itself (the call succeeds, ``reconciled``). An audit-only
  append is sent again; its reply is lost twice (the store's own resend on a fresh
  connection is struck too), and the coordinator's one resend gets the refusal or the grant
  to the caller instead of ``CommitOutcomeUnknown``.
* ``raised``: after the strike every new connection is closed as it opens, so nothing can
  be looked up: the call raises ``CommitOutcomeUnknown`` (and mints no grant). Once the
  network heals, ``reconcile(identity, event_id)`` answers.

Judged for every case: the database holds the write committed (its audit row exactly once,
the lease row as the write left it; for a refusal, its row once and the lease unchanged),
and ``reconcile`` of the event id, from the coordinator that made the call and from a fresh
store on a direct connection, answers whether the write took effect: yes for a write or a
grant issue, no for a refusal, whose audit row carries the event id of the write it refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    CommitOutcomeUnknown,
    ConnectorLeaseCoordinator,
    LeaseHandle,
    LeaseIdentity,
)
from mos_lease.machine import Close, Insert, Renew, Rotate
from mos_lease_pg import (
    AsyncPostgresLeaseStore,
    ConnectionSettings,
    PostgresLeaseStore,
    statements,
)
from tests.faults.lostreply import ReplyLossProxy
from tests.faults.support import Table, run_prefix

pytestmark = [pytest.mark.faults, pytest.mark.pg]

SETTINGS = ConnectionSettings(prepare=False, statement_timeout=timedelta(seconds=1),
                              lock_timeout=timedelta(seconds=0.5), connect_timeout=2.0,
                              call_timeout=1.5)
# Every call here makes at most three store calls (a read or the write, then the audit
# append or the lookup, then the append's one resend or the reread), each within the call
# bound B, reconnecting included (docs/operations.md, "One bound per call"); plus an
# allowance for the deadline watch and a loaded machine.
BOUND = 3 * SETTINGS.call_bound() + 0.5
SCOPES = ["tool:run"]
# A piece of each write statement's text: the proxy strikes the request that carries it.
MARKERS = {"insert": b"ON CONFLICT (tenant_id", "renew": b"SET heartbeat_at",
           "rotate": b"epoch = l.epoch + 1", "close": b"SET released_at",
           "record": b"mos_lease_record_audit("}
TEMPLATES = {"insert": statements.WRITES[Insert], "renew": statements.WRITES[Renew],
             "rotate": statements.WRITES[Rotate], "close": statements.WRITES[Close],
             "record": statements.RECORD}


@dataclass(frozen=True)
class Case:
    """One write kind: the statement struck, the audit row it leaves and whether it is a
    write that took effect (what reconcile must answer)."""

    name: str
    statement: str
    event: str
    outcome: str
    took_effect: bool
    batch: int = 1  # leases the call writes

    @property
    def audit_only(self) -> bool:
        return self.statement == "record"


CASES = (
    Case("acquire", "insert", "acquire", "acquired", True),
    Case("heartbeat", "renew", "heartbeat", "renewed", True),
    Case("takeover", "rotate", "takeover", "taken_over", True),
    Case("release", "close", "release", "released", True),
    Case("heartbeat_many", "renew", "heartbeat", "renewed", True, batch=3),
    Case("issue_grant", "record", "grant_issue", "grant_issued", True),
    Case("acquire refused", "record", "acquire", "denied", False),
    Case("heartbeat refused", "record", "heartbeat", "denied", False),
    Case("takeover refused", "record", "takeover", "denied", False),
    Case("release refused", "record", "release", "denied", False),
)
MODES = ("answered", "raised")


class Gate:
    """A coordinator's calls, made the same way whichever flavour it is: an asyncio one is
    driven on one event loop that lives as long as its store."""

    def __init__(self, coordinator: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        self._coordinator = coordinator
        self._loop = loop

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._coordinator, name)
        if self._loop is None or not callable(method):
            return method  # type: ignore[no-any-return]
        loop = self._loop
        return lambda *args, **kwargs: loop.run_until_complete(method(*args, **kwargs))


@dataclass
class Outcome:
    """What one case saw."""

    case: str
    mode: str
    strikes: int
    raised: bool
    answer: str  # what the call returned: "ok", "reconciled", a refusal's reason, "grant"
    seconds: float  # how long the call took, on the monotonic clock
    rows: int  # audit rows of the event (kind, outcome) for the identities written
    lease_as_written: bool
    reconcile_same: bool | None  # reconcile from the coordinator that made the call
    reconcile_fresh: bool | None  # reconcile from a fresh store, direct connection
    problems: list[str]


def _lease(admin: psycopg.Connection[Any], identity: LeaseIdentity) -> tuple[Any, ...] | None:
    return admin.execute(
        "SELECT lease_id, epoch, connector_id, expires_at, released_at "
        "FROM mos_lease.logical_agent_connector_leases WHERE tenant_id = %s AND "
        "logical_agent_id = %s AND binding_id = %s", (
            identity.tenant_id, identity.logical_agent_id, identity.binding_id)).fetchone()


def _events(admin: psycopg.Connection[Any], identity: LeaseIdentity, event: str,
            outcome: str) -> list[UUID]:
    rows = admin.execute(
        "SELECT event_id FROM mos_lease.connector_lease_audit_log WHERE tenant_id = %s AND "
        "logical_agent_id = %s AND binding_id = %s AND event = %s AND outcome = %s "
        "ORDER BY seq", (identity.tenant_id, identity.logical_agent_id, identity.binding_id,
                         event, outcome)).fetchall()
    return [row[0] for row in rows]


def _forged(lease: LeaseHandle) -> LeaseHandle:
    """The holder's handle with another connector: refused by the store's full match."""
    return LeaseHandle(lease.identity, "conn-x", lease.lease_id, lease.epoch, lease.scopes,
                       lease.expires_at)


def _run_case(case: Case, mode: str, gate: Gate, proxy: ReplyLossProxy, fresh: Gate,
              admin: psycopg.Connection[Any], prefix: str) -> Outcome:
    identities = [LeaseIdentity(prefix, f"{case.name.replace(' ', '-')}-{mode}", f"b{i}")
                  for i in range(case.batch)]
    identity = identities[0]
    problems: list[str] = []
    handles: list[LeaseHandle] = []
    if case.name != "acquire":
        for each in identities:
            held = gate.acquire(each, "conn-a", scopes=SCOPES, ttl=60)
            assert held.lease is not None, f"{case.name}: set-up acquire {held}"
            handles.append(held.lease)
    before = _lease(admin, identity)
    # Through the store's own resend too, for an append in the answered mode: only the
    # coordinator's resend gets through.
    times = 2 if case.audit_only and mode == "answered" else 1
    proxy.arm(MARKERS[case.statement], times=times, then_refuse=mode == "raised")
    calls: dict[str, Callable[[], Any]] = {
        "acquire": lambda: gate.acquire(identity, "conn-a", scopes=SCOPES, ttl=60),
        "heartbeat": lambda: gate.heartbeat(handles[0], ttl=60),
        "takeover": lambda: gate.takeover(identity, "conn-b", scopes=SCOPES, ttl=60,
                                          expected_epoch=1),
        "release": lambda: gate.release(handles[0]),
        "heartbeat_many": lambda: gate.heartbeat_many(handles, ttl=60),
        "issue_grant": lambda: gate.issue_grant(handles[0], scopes=SCOPES, ttl=10),
        "acquire refused": lambda: gate.acquire(identity, "conn-b", scopes=SCOPES, ttl=60),
        "heartbeat refused": lambda: gate.heartbeat(_forged(handles[0]), ttl=60),
        "takeover refused": lambda: gate.takeover(identity, "conn-b", scopes=SCOPES, ttl=60,
                                                  expected_epoch=5),
        "release refused": lambda: gate.release(_forged(handles[0])),
    }
    grants = gate.live_grants
    event_id: UUID | None = None
    raised = False
    answer = "-"
    began = time.monotonic()
    try:
        result = calls[case.name]()
    except CommitOutcomeUnknown as unknown:
        raised, event_id = True, unknown.event_id
    else:
        answer = _answer(case, result, problems)
    seconds = time.monotonic() - began
    strikes = proxy.strikes
    proxy.heal()
    if raised != (mode == "raised"):
        problems.append(f"raised={raised} in mode {mode}")
    if case.name == "issue_grant" and raised and gate.live_grants != grants:
        problems.append("a grant whose audit row is not known committed was handed out")
    rows = [_events(admin, each, case.event, case.outcome) for each in identities]
    if any(len(found) != 1 for found in rows):
        problems.append(f"audit rows {case.event}/{case.outcome}: {[len(f) for f in rows]}")
    if event_id is None and rows[0]:
        event_id = rows[0][0]
    elif event_id is not None and event_id not in rows[0]:
        problems.append("the raised event id is not the row's")
    after = _lease(admin, identity)
    as_written = _lease_as_written(case, before, after, handles)
    same = fresh_answer = None
    if event_id is not None:
        same = gate.reconcile(identity, event_id)
        fresh_answer = fresh.reconcile(identity, event_id)
    return Outcome(case.name, mode, strikes, raised, answer, seconds, sum(len(f) for f in rows),
                   as_written, same, fresh_answer, problems)


def _answer(case: Case, result: Any, problems: list[str]) -> str:
    if case.name == "heartbeat_many":
        if not all(r.ok and r.reconciled for r in result):
            problems.append(f"batch results {result}")
        return "reconciled"
    if case.name == "issue_grant":
        if result.grant is None:
            problems.append(f"no grant: {result}")
        return "grant"
    if not case.took_effect:
        if result.reason is None:
            problems.append(f"refusal expected: {result}")
        return str(result.reason)
    if not (result.ok and result.reconciled):
        problems.append(f"not reconciled: {result}")
    return "reconciled"


def _lease_as_written(case: Case, before: tuple[Any, ...] | None,
                      after: tuple[Any, ...] | None, handles: list[LeaseHandle]) -> bool:
    """Whether the lease row is what the write committed (unchanged for an audit-only one)."""
    if after is None:
        return False
    if case.audit_only:
        return after == before
    if case.name == "acquire":
        return bool(after[1] == 1)
    assert before is not None
    if case.name == "takeover":
        return bool(after[1] == before[1] + 1 and after[2] == "conn-b")
    if case.name == "release":
        return after[4] is not None
    return bool(after[3] > before[3])  # a renewal moved the expiry


@pytest.fixture
def loss_proxy(pg_dsn: str) -> Iterator[ReplyLossProxy]:
    proxy = ReplyLossProxy(pg_dsn)
    try:
        yield proxy
    finally:
        proxy.close()


def _gates(flavour: str, proxy: ReplyLossProxy, pg_dsn: str
           ) -> tuple[Gate, Gate, Callable[[], None]]:
    """The coordinator under test (through the proxy) and a fresh one (direct), and what
    closes both."""
    if flavour == "sync":
        store = PostgresLeaseStore(proxy.dsn, settings=SETTINGS)
        direct = PostgresLeaseStore(pg_dsn, settings=SETTINGS)

        def close() -> None:
            store.close()
            direct.close()

        return (Gate(ConnectorLeaseCoordinator(store, AllowAllPolicy()), None),
                Gate(ConnectorLeaseCoordinator(direct, AllowAllPolicy()), None), close)
    loop = asyncio.new_event_loop()
    astore = AsyncPostgresLeaseStore(proxy.dsn, settings=SETTINGS)
    adirect = AsyncPostgresLeaseStore(pg_dsn, settings=SETTINGS)

    def close_async() -> None:
        loop.run_until_complete(astore.aclose())
        loop.run_until_complete(adirect.aclose())
        loop.close()

    return (Gate(AsyncConnectorLeaseCoordinator(astore, AllowAllPolicy()), loop),
            Gate(AsyncConnectorLeaseCoordinator(adirect, AllowAllPolicy()), loop), close_async)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_reply_lost_after_commit(flavour: str, loss_proxy: ReplyLossProxy, pg_dsn: str,
                                 admin: psycopg.Connection[Any], figures: Table,
                                 caplog: pytest.LogCaptureFixture) -> None:
    for name, marker in MARKERS.items():  # a statement that changed would never be struck
        assert marker in TEMPLATES[name].text.encode(), name
    prefix = run_prefix(f"s24{flavour[0]}")
    gate, fresh, close = _gates(flavour, loss_proxy, pg_dsn)
    outcomes: list[Outcome] = []
    try:
        with caplog.at_level(logging.WARNING, logger="mos_lease"):
            for case in CASES:
                for mode in MODES:
                    outcomes.append(_run_case(case, mode, gate, loss_proxy, fresh, admin,
                                              prefix))
    finally:
        close()
    truth = {case.name: case.took_effect for case in CASES}

    def expected_strikes(o: Outcome) -> int:
        audit_only = next(c for c in CASES if c.name == o.case).audit_only
        return 2 if audit_only and o.mode == "answered" else 1

    unstruck = [f"{o.case}/{o.mode}" for o in outcomes if o.strikes != expected_strikes(o)]
    wrong_raise = [f"{o.case}/{o.mode}" for o in outcomes if o.raised != (o.mode == "raised")]
    not_committed = [f"{o.case}/{o.mode}" for o in outcomes
                     if o.rows != next(c.batch for c in CASES if c.name == o.case)]
    lease_wrong = [f"{o.case}/{o.mode}" for o in outcomes if not o.lease_as_written]
    untruthful = [f"{o.case}/{o.mode}: {o.reconcile_same}/{o.reconcile_fresh}"
                  for o in outcomes
                  if o.reconcile_same is not truth[o.case]
                  or o.reconcile_fresh is not truth[o.case]]
    other = [f"{o.case}/{o.mode}: {p}" for o in outcomes for p in o.problems]
    resent = caplog.text.count("audit append outcome unknown, sending it again")
    figures.add("cases (write kinds x modes)", f"{len(outcomes)} on {flavour} stores", "20",
                len(outcomes) == len(CASES) * len(MODES))
    longest = max(outcomes, key=lambda o: o.seconds)
    figures.add("longest call", f"{longest.seconds:.3f} s ({longest.case}/{longest.mode})",
                f"<= 3 B + 0.5 s = {BOUND:g} s", longest.seconds <= BOUND)
    figures.add("replies lost after their commit", sum(o.strikes for o in outcomes),
                "every case struck as armed", not unstruck)
    figures.add("answered mode: results", dict(Counter(
        o.answer for o in outcomes if o.mode == "answered")), "no CommitOutcomeUnknown",
        not wrong_raise)
    figures.add("raised mode: CommitOutcomeUnknown", sum(o.raised for o in outcomes),
                f"{len(CASES)}", not wrong_raise)
    appends = sum(c.audit_only for c in CASES) * len(MODES)
    figures.add("audit appends sent again by the coordinator", resent,
                f"{appends} (once per audit-only case)", resent == appends)
    figures.add("database: the struck write committed, once", len(outcomes) - len(not_committed),
                f"{len(outcomes)}", not not_committed)
    figures.add("database: lease row as the write left it", len(outcomes) - len(lease_wrong),
                f"{len(outcomes)}", not lease_wrong)
    figures.add("reconcile (same and fresh store) truthful", len(outcomes) - len(untruthful),
                f"{len(outcomes)} (refusals: not committed)", not untruthful)
    figures.add("other problems", len(other), "0", not other)
    if unstruck:
        figures.notes.append(f"struck otherwise than armed: {unstruck}")
    figures.notes += untruthful[:10] + other[:10] + not_committed[:5] + lease_wrong[:5]
    assert not figures.failed(), figures.render()
