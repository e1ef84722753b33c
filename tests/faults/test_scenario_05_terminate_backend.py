"""Scenario 5: connection killed with pg_terminate_backend at every statement boundary.

Every lifecycle operation (success and refusal paths) is first run once through a
protocol-aware proxy that counts its requests to the server (a request ends with a Sync or a
simple Query message; a statement prepared on first use is two requests). Then, for every
request k of it, the operation is run again on a fresh identity and the proxy terminates
the session with ``pg_terminate_backend``:

* ``before``: request k is held back, the backend is terminated, the request never arrives;
* ``after``: request k runs and commits, its reply is held back, the backend is terminated,
  the client never sees the reply;
* ``during`` (soak only): request k is sent and the backend terminated at once, racing it.

Each outcome must be classified correctly: a success was committed exactly once, a refusal or
``StoreUnavailable`` changed nothing, and a ``CommitOutcomeUnknown`` is settled by
``reconcile`` to what the database holds. The history checker then finds no takeover applied
twice and no audit row lost or duplicated.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    CommitOutcomeUnknown,
    LeaseHandle,
    LeaseIdentity,
    StoreUnavailable,
    ValidationResult,
)
from mos_lease_pg import AsyncPostgresLeaseStore
from tests.faults.gateway import SCOPES, Gateway
from tests.faults.history import OpRecord, Status, check_history, read_records
from tests.faults.support import Table, audit_rows, final_rows, run_prefix, scaled
from tests.pg_support import LoopbackRelay

pytestmark = [pytest.mark.faults, pytest.mark.pg]

_SSL_OR_GSS = {80877103, 80877104}


@dataclass
class _Conn:
    client: socket.socket
    upstream: socket.socket
    pid: int | None = None
    # Indexes (global request numbers) of requests forwarded and not yet answered.
    pending: list[int] = field(default_factory=list)
    hold_reply_of: int | None = None


class TerminatingProxy(LoopbackRelay):
    """A loopback proxy that speaks just enough of the PostgreSQL protocol to count requests
    and terminate the backend at a chosen request boundary."""

    def __init__(self, target_dsn: str, admin_dsn: str) -> None:
        super().__init__(target_dsn)
        self._admin = psycopg.connect(admin_dsn, autocommit=True,
                                      application_name="faults-terminator")
        self._lock = threading.Lock()
        self.requests = 0  # requests seen since the last reset
        self._armed: tuple[int, str] | None = None
        self.fired: str | None = None
        self.fired_event = threading.Event()
        self._conns: list[_Conn] = []
        self.dsn = make_conninfo(target_dsn, host="127.0.0.1", port=str(self.port),
                                 sslmode="disable", gssencmode="disable")
        self._start()

    def reset(self, arm: tuple[int, str] | None = None) -> None:
        """Start counting from zero; ``arm=(k, mode)`` terminates at request k."""
        with self._lock:
            self.requests = 0
            self._armed = arm
            self.fired = None
            self.fired_event.clear()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        conn = _Conn(client, upstream)
        with self._lock:
            self._conns.append(conn)
        self._spawn(self._client_pump, conn)
        self._spawn(self._server_pump, conn)

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def _terminate(self, conn: _Conn) -> None:
        if conn.pid is not None:
            with contextlib.suppress(psycopg.Error):
                self._admin.execute("SELECT pg_terminate_backend(%s)", (conn.pid,))

    def _close(self, conn: _Conn) -> None:
        self._hang_up(conn.client, conn.upstream)

    def _client_pump(self, conn: _Conn) -> None:
        try:
            # Startup: untyped messages until the StartupMessage itself.
            while True:
                head = self._recv_exact(conn.client, 8)
                length, code = struct.unpack("!ii", head)
                body = self._recv_exact(conn.client, length - 8)
                conn.upstream.sendall(head + body)
                if code not in _SSL_OR_GSS:
                    break
            request = b""
            while True:
                head = self._recv_exact(conn.client, 5)
                kind = head[:1]
                (length,) = struct.unpack("!i", head[1:])
                message = head + self._recv_exact(conn.client, length - 4)
                request += message
                if kind not in (b"S", b"Q"):
                    if kind == b"X":  # Terminate: pass it on at once
                        conn.upstream.sendall(request)
                        request = b""
                    continue
                # A request is complete: decide its fate.
                with self._lock:
                    index = self.requests
                    self.requests += 1
                    armed = self._armed
                    fire = armed is not None and armed[0] == index and self.fired is None
                    if fire:
                        assert armed is not None
                        self.fired = armed[1]
                        self._armed = None
                if fire and self.fired == "before":
                    self._terminate(conn)  # the request never reaches the server
                    self.fired_event.set()
                    request = b""
                    continue
                if fire and self.fired == "after":
                    conn.hold_reply_of = index
                conn.pending.append(index)
                conn.upstream.sendall(request)
                request = b""
                if fire and self.fired == "during":
                    # Racing the statement: it may or may not have run, or committed.
                    self._terminate(conn)
                    self.fired_event.set()
        except (OSError, ConnectionError):
            self._close(conn)

    def _server_pump(self, conn: _Conn) -> None:
        held = False
        try:
            while True:
                head = self._recv_exact(conn.upstream, 5)
                kind = head[:1]
                (length,) = struct.unpack("!i", head[1:])
                message = head + self._recv_exact(conn.upstream, length - 4)
                if kind == b"K" and conn.pid is None:
                    conn.pid = struct.unpack("!i", message[5:9])[0]
                current = conn.pending[0] if conn.pending else None
                if current is not None and current == conn.hold_reply_of:
                    held = True
                if held:
                    # The reply of the chosen request is swallowed whole.
                    if kind == b"Z":
                        conn.pending.pop(0)
                        conn.hold_reply_of = None
                        held = False
                        self._terminate(conn)  # it ran and committed; now kill the session
                        self.fired_event.set()
                    continue
                if kind == b"Z" and conn.pending:
                    conn.pending.pop(0)
                conn.client.sendall(message)
        except (OSError, ConnectionError):
            self._close(conn)

    def close(self) -> None:
        self._stop_accepting()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            self._close(conn)
        self._join()
        for conn in conns:
            conn.client.close()
            conn.upstream.close()
        self._admin.close()


# --- the operations -----------------------------------------------------------------------


@dataclass
class Env:
    victim: Gateway  # its store goes through the proxy
    setup: Gateway  # direct: builds the state before the operation
    tmp: Path


Op = Callable[[], list[OpRecord]]
Prepare = Callable[[Env, LeaseIdentity], Op]
TTL = 30.0


def _lease(gw: Gateway, identity: LeaseIdentity) -> LeaseHandle:
    result = gw.acquire(identity, ttl=TTL)
    assert result is not None and result.lease is not None, result
    return result.lease


def _take(gw: Gateway, identity: LeaseIdentity, epoch: int) -> LeaseHandle:
    result = gw.takeover(identity, ttl=TTL, expected_epoch=epoch)
    assert result is not None and result.lease is not None, result
    return result.lease


def _last(gw: Gateway, n: int = 1) -> list[OpRecord]:
    return gw.rec.records[-n:]


def _acquire_new(env: Env, identity: LeaseIdentity) -> Op:
    return lambda: (env.victim.acquire(identity, ttl=TTL), _last(env.victim))[1]


def _acquire_held(env: Env, identity: LeaseIdentity) -> Op:
    _lease(env.setup, identity)
    return lambda: (env.victim.acquire(identity, ttl=TTL), _last(env.victim))[1]


def _takeover_preempt(env: Env, identity: LeaseIdentity) -> Op:
    _lease(env.setup, identity)
    return lambda: (env.victim.takeover(identity, ttl=TTL, expected_epoch=1),
                    _last(env.victim))[1]


def _takeover_mismatch(env: Env, identity: LeaseIdentity) -> Op:
    _lease(env.setup, identity)
    return lambda: (env.victim.takeover(identity, ttl=TTL, expected_epoch=7),
                    _last(env.victim))[1]


def _heartbeat_ok(env: Env, identity: LeaseIdentity) -> Op:
    lease = _lease(env.victim, identity)
    return lambda: (env.victim.heartbeat(lease, ttl=TTL), _last(env.victim))[1]


def _heartbeat_stale(env: Env, identity: LeaseIdentity) -> Op:
    lease = _lease(env.victim, identity)
    _take(env.setup, identity, lease.epoch)
    return lambda: (env.victim.heartbeat(lease, ttl=TTL), _last(env.victim))[1]


def _heartbeat_many(env: Env, identity: LeaseIdentity) -> Op:
    other = LeaseIdentity(identity.tenant_id, identity.logical_agent_id,
                          identity.binding_id + "-2")
    leases = [_lease(env.victim, identity), _lease(env.victim, other)]
    return lambda: env.victim.heartbeat_many(leases, ttl=TTL)


def _release_ok(env: Env, identity: LeaseIdentity) -> Op:
    lease = _lease(env.victim, identity)
    return lambda: (env.victim.release(lease), _last(env.victim))[1]


def _release_stale(env: Env, identity: LeaseIdentity) -> Op:
    lease = _lease(env.victim, identity)
    _take(env.setup, identity, lease.epoch)
    return lambda: (env.victim.release(lease), _last(env.victim))[1]


def _grant_ok(env: Env, identity: LeaseIdentity) -> Op:
    lease = _lease(env.victim, identity)
    return lambda: (env.victim.issue_grant(lease, ttl=10), _last(env.victim))[1]


def _grant_stale(env: Env, identity: LeaseIdentity) -> Op:
    lease = _lease(env.victim, identity)
    _take(env.setup, identity, lease.epoch)
    return lambda: (env.victim.issue_grant(lease, ttl=10), _last(env.victim))[1]


def _validate_ok(env: Env, identity: LeaseIdentity) -> Op:
    lease = _lease(env.victim, identity)
    granted = env.victim.issue_grant(lease, ttl=10)
    assert granted is not None and granted.grant is not None
    grant = granted.grant
    return lambda: (env.victim.validate(grant), _last(env.victim))[1]


def _validate_stale(env: Env, identity: LeaseIdentity) -> Op:
    lease = _lease(env.victim, identity)
    granted = env.victim.issue_grant(lease, ttl=10)
    assert granted is not None and granted.grant is not None
    grant = granted.grant
    _take(env.setup, identity, lease.epoch)
    return lambda: (env.victim.validate(grant), _last(env.victim))[1]


VARIANTS: dict[str, Prepare] = {
    "acquire (new)": _acquire_new,
    "acquire (held: refused)": _acquire_held,
    "takeover (preempt)": _takeover_preempt,
    "takeover (epoch mismatch: refused)": _takeover_mismatch,
    "heartbeat": _heartbeat_ok,
    "heartbeat (stale: refused)": _heartbeat_stale,
    "heartbeat_many (2 leases)": _heartbeat_many,
    "release": _release_ok,
    "release (stale: refused)": _release_stale,
    "grant issue": _grant_ok,
    "grant issue (stale: refused)": _grant_stale,
    "validate": _validate_ok,
    "validate (stale: refused)": _validate_stale,
}


@dataclass
class Trial:
    variant: str
    boundary: int
    mode: str
    records: list[OpRecord]
    truth: list[bool | None]  # per record: did a success row / the in-doubt event commit?
    verdict: str = ""


def _event_id(record: OpRecord) -> UUID | None:
    if record.detail.startswith("CommitOutcomeUnknown "):
        return UUID(record.detail.split()[1])
    return None


def _classify(env: Env, admin: psycopg.Connection[Any], record: OpRecord) -> tuple[str, bool]:
    """Name the outcome and whether it is classified correctly against the database."""
    success = {"acquire": "acquired", "takeover": "taken_over", "heartbeat": "renewed",
               "release": "released", "grant_issue": "grant_issued"}.get(record.op.value)
    rows = admin.execute(
        "SELECT outcome FROM connector_lease_audit_log WHERE correlation_id = %s "
        "AND tenant_id = %s AND logical_agent_id = %s AND binding_id = %s",
        (record.key, *record.identity)).fetchall()
    committed = sum(1 for (outcome,) in rows if outcome == success)
    if record.status is Status.OK:
        name = "committed (reconciled)" if record.reconciled else "committed"
        return name, success is None or committed == 1
    if record.status in (Status.DENIED, Status.ERROR):
        name = "not committed" if record.status is Status.DENIED else "store unavailable"
        return name, committed == 0
    event_id = _event_id(record)
    if event_id is None:
        return f"crash: {record.detail[:80]}", False
    # The caller's way out of an unknown outcome: ask, now that the connection is back.
    identity = LeaseIdentity(*record.identity)
    try:
        answer = env.victim.coordinator.reconcile(identity, event_id)
    except StoreUnavailable:
        return "unknown, reconcile unavailable", False
    truth = admin.execute("SELECT EXISTS (SELECT 1 FROM connector_lease_audit_log "
                          "WHERE event_id = %s)", (event_id,)).fetchone()
    assert truth is not None
    name = "unknown -> reconciled " + ("committed" if answer else "not committed")
    return name, answer == truth[0] and committed == int(truth[0])


def _run_variant(env: Env, proxy: TerminatingProxy, prefix: str, name: str,
                 prepare: Prepare, repeats: int,
                 modes: tuple[str, ...]) -> tuple[int, list[Trial], int]:
    """Count the variant's requests, then kill at each of them; returns (count, trials,
    retried trials)."""
    tag = name.split(maxsplit=1)[0] + str(len(env.victim.rec.records))
    warmed = 0

    def warm() -> None:
        # Twice: a killed session can be noticed only by the first warm-up, which then
        # leaves some statements unprepared on the new connection; the second prepares
        # them, so every trial sees the same requests as the dry run.
        nonlocal warmed
        for _ in range(2):
            warmed += 1
            prepare(env, LeaseIdentity(prefix, f"warm-{tag}", f"w{warmed}"))()

    counts: list[int] = []
    while len(counts) < 2 or counts[-1] != counts[-2]:
        assert len(counts) < 6, f"{name}: request count never settled: {counts}"
        warm()
        op = prepare(env, LeaseIdentity(prefix, f"dry-{tag}", f"d{len(counts)}"))
        proxy.reset()
        op()
        counts.append(proxy.requests)
    count = counts[-1]
    trials: list[Trial] = []
    retried = 0
    for r in range(repeats):
        for boundary in range(count):
            for mode in modes:
                for attempt in range(3):
                    warm()
                    identity = LeaseIdentity(prefix, f"t-{tag}-{r}-{attempt}",
                                             f"k{boundary}-{mode}")
                    proxy.reset()
                    op = prepare(env, identity)
                    proxy.reset(arm=(boundary, mode))
                    records = op()
                    fired = proxy.fired
                    proxy.reset()
                    if fired == mode:
                        trials.append(Trial(name, boundary, mode, records, []))
                        break
                    retried += 1  # the operation took fewer requests this time: again
                else:
                    raise AssertionError(f"{name} @{boundary}/{mode} never fired")
    return count, trials, retried


def test_terminate_backend_at_every_boundary(pg_dsn: str, admin: psycopg.Connection[Any],
                                             soak: bool, figures: Table,
                                             tmp_path: Path) -> None:
    repeats = scaled(soak, 1, 5)
    modes = ("before", "after", "during") if soak else ("before", "after")
    prefix = run_prefix("s5")
    proxy = TerminatingProxy(pg_dsn, pg_dsn)
    victim = Gateway({"dsn": proxy.dsn, "clock_dsn": pg_dsn, "process": "victim",
                      "connector": "victim", "records": str(tmp_path / "victim.jsonl"),
                      "connect_timeout": 2})
    setup = Gateway({"dsn": pg_dsn, "process": "setup", "connector": "setup",
                     "records": str(tmp_path / "setup.jsonl")})
    env = Env(victim, setup, tmp_path)
    trials: list[Trial] = []
    counts: dict[str, int] = {}
    verdicts: Counter[str] = Counter()
    wrong: list[str] = []
    try:
        retried = 0
        for name, prepare in VARIANTS.items():
            counts[name], made, again = _run_variant(env, proxy, prefix, name, prepare,
                                                     repeats, modes)
            trials += made
            retried += again
        for trial in trials:
            for record in trial.records:
                label, right = _classify(env, admin, record)
                verdicts[label] += 1
                if not right:
                    wrong.append(f"{trial.variant} @{trial.boundary}/{trial.mode}: {label} "
                                 f"({record.status}, {record.reason}, {record.detail[:120]})")
    finally:
        victim.close()
        setup.close()
        proxy.close()

    records = read_records(tmp_path.glob("*.jsonl"))
    audit = audit_rows(admin, prefix)
    violations = check_history(records, audit, final_rows=final_rows(admin, prefix))
    takeovers_twice = [f for f in final_rows(admin, prefix) if f.epoch > 2]

    figures.add("spec. figure", "every statement boundary of every lifecycle operation")
    figures.add(f"operations x boundaries x {{{', '.join(modes)}}} x {repeats}",
                f"{len(VARIANTS)} ops, {sum(counts.values())} boundaries, {len(trials)} trials")
    figures.add("requests per operation", ", ".join(f"{k}={v}" for k, v in counts.items()))
    figures.add("trials run again (boundary not reached the first time)", retried)
    figures.add("outcomes", dict(verdicts.most_common()))
    figures.add("misclassified outcomes", len(wrong), "0", not wrong)
    figures.add("takeovers applied twice (epoch > 2)", len(takeovers_twice), "0",
                not takeovers_twice)
    figures.add("history checker violations (audit lost / duplicated ...)", len(violations),
                "0", not violations)
    figures.notes += wrong[:15]
    figures.notes += [str(v) for v in violations[:15]]
    assert not figures.failed(), figures.render()


# --- the asyncio store: the same kills, the same classification ---------------------------

AsyncOp = Callable[[], Awaitable[Any]]


async def _async_variants(c: AsyncConnectorLeaseCoordinator,
                          setup: AsyncConnectorLeaseCoordinator, name: str,
                          identity: LeaseIdentity, corr: str) -> AsyncOp:
    """Prepare ``name`` on ``identity``; return the call to make (with ``corr``)."""
    if name == "acquire (new)":
        return lambda: c.acquire(identity, "victim", scopes=SCOPES, ttl=TTL,
                                 correlation_id=corr)
    if name == "takeover (preempt)":
        await setup.acquire(identity, "setup", scopes=SCOPES, ttl=TTL)
        return lambda: c.takeover(identity, "victim", scopes=SCOPES, ttl=TTL,
                                  expected_epoch=1, correlation_id=corr)
    got = await c.acquire(identity, "victim", scopes=SCOPES, ttl=TTL)
    assert got.lease is not None
    lease = got.lease
    if name == "heartbeat":
        return lambda: c.heartbeat(lease, ttl=TTL, correlation_id=corr)
    if name == "heartbeat_many":
        return lambda: c.heartbeat_many([lease], ttl=TTL, correlation_id=corr)
    if name == "release":
        return lambda: c.release(lease, correlation_id=corr)
    if name == "grant issue":
        return lambda: c.issue_grant(lease, scopes=SCOPES, ttl=10, correlation_id=corr)
    granted = await c.issue_grant(lease, scopes=SCOPES, ttl=10)
    assert granted.grant is not None
    grant = granted.grant
    if name == "validate (stale: refused)":
        await setup.takeover(identity, "setup", scopes=SCOPES, ttl=TTL, expected_epoch=1)
    return lambda: c.validate(grant, identity=identity, scopes=SCOPES, correlation_id=corr)


ASYNC_VARIANTS = ("acquire (new)", "takeover (preempt)", "heartbeat", "heartbeat_many",
                  "release", "grant issue", "validate", "validate (stale: refused)")


def _async_truth(admin: psycopg.Connection[Any], identity: LeaseIdentity,
                 corr: str) -> int:
    row = admin.execute(
        "SELECT count(*) FROM connector_lease_audit_log WHERE correlation_id = %s AND "
        "tenant_id = %s AND logical_agent_id = %s AND binding_id = %s AND outcome <> 'denied'",
        (corr, identity.tenant_id, identity.logical_agent_id, identity.binding_id)).fetchone()
    assert row is not None
    return int(row[0])


async def _async_run(pg_dsn: str, admin: psycopg.Connection[Any], proxy: TerminatingProxy,
                     prefix: str, modes: tuple[str, ...]) -> tuple[int, Counter[str], list[str]]:
    """(trials, outcomes, misclassified) for the asyncio store behind the proxy."""
    store = AsyncPostgresLeaseStore(proxy.dsn)
    setup_store = AsyncPostgresLeaseStore(pg_dsn)
    c = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
    setup = AsyncConnectorLeaseCoordinator(setup_store, AllowAllPolicy())
    outcomes: Counter[str] = Counter()
    wrong: list[str] = []
    trials = 0
    serial = 0

    async def warm(name: str, tag: str) -> None:
        nonlocal serial
        for _ in range(2):  # twice, as in the sync trials
            serial += 1
            await (await _async_variants(c, setup, name, LeaseIdentity(
                prefix, f"a-warm-{tag}", f"w{serial}"), f"warm-{serial}"))()

    try:
        for name in ASYNC_VARIANTS:
            tag = name.split(maxsplit=1)[0] + name[-8:].replace(" ", "")
            counts: list[int] = []
            while len(counts) < 2 or counts[-1] != counts[-2]:
                assert len(counts) < 6, f"async {name}: count never settled: {counts}"
                await warm(name, tag)
                op = await _async_variants(c, setup, name, LeaseIdentity(
                    prefix, f"a-dry-{tag}", f"d{len(counts)}"), f"dry-{tag}-{len(counts)}")
                proxy.reset()
                await op()
                counts.append(proxy.requests)
            for boundary in range(counts[-1]):
                for mode in modes:
                    for _attempt in range(3):
                        await warm(name, tag)
                        serial += 1
                        corr = f"async-{serial}"
                        identity = LeaseIdentity(prefix, f"a-{tag}", f"k{serial}")
                        proxy.reset()
                        op = await _async_variants(c, setup, name, identity, corr)
                        proxy.reset(arm=(boundary, mode))
                        label, right = await _async_classify(c, admin, op, identity, corr)
                        fired = proxy.fired
                        proxy.reset()
                        if fired != mode:
                            continue  # fewer requests this time: run it again
                        trials += 1
                        outcomes[label] += 1
                        if not right:
                            wrong.append(f"async {name} @{boundary}/{mode}: {label}")
                        break
                    else:
                        wrong.append(f"async {name} @{boundary}/{mode}: never fired")
    finally:
        await store.aclose()
        await setup_store.aclose()
    return trials, outcomes, wrong


async def _async_classify(c: AsyncConnectorLeaseCoordinator, admin: psycopg.Connection[Any],
                          op: AsyncOp, identity: LeaseIdentity, corr: str) -> tuple[str, bool]:
    try:
        result = await op()
    except StoreUnavailable:
        return "store unavailable", _async_truth(admin, identity, corr) == 0
    except CommitOutcomeUnknown as unknown:
        answer = await c.reconcile(identity, unknown.event_id)
        truth = _async_truth(admin, identity, corr)
        return f"unknown -> reconciled {answer}", answer == (truth == 1)
    except Exception as exc:  # a crash
        return f"crash: {type(exc).__name__}: {exc}", False
    results = result if isinstance(result, list) else [result]
    ok = all(r.ok for r in results)
    truth = _async_truth(admin, identity, corr)
    if isinstance(result, ValidationResult):
        return ("validated" if ok else "refused"), truth == 0
    label = "committed" if ok else "not committed"
    if ok and any(getattr(r, "reconciled", False) for r in results):
        label += " (reconciled)"
    return label, truth == (1 if ok else 0)


def test_terminate_backend_async_store(pg_dsn: str, admin: psycopg.Connection[Any],
                                       soak: bool, figures: Table) -> None:
    modes = ("before", "after", "during") if soak else ("before", "after")
    figures.scenario += " (asyncio store)"
    prefix = run_prefix("s5a")
    proxy = TerminatingProxy(pg_dsn, pg_dsn)
    try:
        trials, outcomes, wrong = asyncio.run(_async_run(pg_dsn, admin, proxy, prefix,
                                                         modes))
    finally:
        proxy.close()
    figures.add("asyncio store: operations x boundaries x modes",
                f"{len(ASYNC_VARIANTS)} ops, {trials} trials ({', '.join(modes)})")
    figures.add("outcomes", dict(outcomes.most_common()))
    figures.add("misclassified outcomes", len(wrong), "0", not wrong)
    figures.notes += wrong[:15]
    assert not figures.failed(), figures.render()
