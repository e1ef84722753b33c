"""End to end: two example gateway processes on one database, and the holder is killed.

As ``examples/README.md`` says: on a database after ``mos-lease setup``, the example's
tables made by ``gateway.py setup`` as a superuser, and both gateways connected as the
least-privileged gateway role.

The survivor takes the lease over once it expires, and every effect the dead gateway's
leftover work still tries (replayed from the last context and token it printed, in a
separate process as well as from here) is refused at both effect boundaries: the ledger
(fenced transaction on the lease row) and the mailbox (resource guard on the token).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs
import psycopg
import pytest

from mos_lease import InvalidInput, LeaseIdentity, Reason
from mos_lease.fencing import FencedEffectRefused, FenceReason
from mos_lease.token import FencingToken, format_token, parse_token
from mos_lease_pg.effects import fenced_transaction
from mos_lease_pg.fencing import PostgresResourceGuard
from tests.pg_fixtures import SetUpDatabase

pytestmark = [pytest.mark.e2e, pytest.mark.pg]

GATEWAY = Path(__file__).resolve().parents[2] / "examples" / "gateway.py"
KEY = bytes(range(32))
TTL = 2.0
Event = dict[str, Any]


class Gateway:
    """One ``examples/gateway.py`` process; its JSON lines are collected as they arrive."""

    def __init__(self, dsn: str, connector_id: str, tenant: str, log_dir: Path) -> None:
        self.name = connector_id
        self.stderr_path = log_dir / f"{connector_id}.stderr"
        self._stderr: IO[str] = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(GATEWAY), "serve", "--dsn", dsn, "--connector-id",
             connector_id, "--tenant", tenant, "--ttl", str(TTL), "--interval", "0.1",
             "--key-hex", KEY.hex()],
            stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.events: list[Event] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.events.append(json.loads(line))
                self._changed.notify_all()

    def wait_for(self, predicate: Callable[[Event], bool], what: str,
                 timeout: float = 15.0) -> Event:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"{self.name}: no {what} in {self.events[-5:]}; stderr:\n"
                        f"{self.stderr_path.read_text()[-2000:]}")
                self._changed.wait(min(left, 0.1))

    def effects(self) -> list[Event]:
        with self._changed:
            return [e for e in self.events if e["event"] == "effect"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@attrs.define
class Gateways:
    dsn: str  # as the gateway role
    tenant: str
    log_dir: Path
    started: list[Gateway] = attrs.Factory(list)

    def start(self, connector_id: str) -> Gateway:
        gateway = Gateway(self.dsn, connector_id, self.tenant, self.log_dir)
        self.started.append(gateway)
        return gateway


@pytest.fixture
def database(pg_set_up: SetUpDatabase) -> SetUpDatabase:
    done = subprocess.run([sys.executable, str(GATEWAY), "setup", "--dsn", pg_set_up.admin_dsn],
                          capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout)["event"] == "set_up"
    return pg_set_up


@pytest.fixture
def admin(database: SetUpDatabase) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database.admin_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def gateways(database: SetUpDatabase, pg_tenant: str, tmp_path: Path) -> Iterator[Gateways]:
    made = Gateways(database.gateway_dsn, pg_tenant, tmp_path)
    try:
        yield made
    finally:
        for gateway in made.started:
            gateway.close()


def effect_is(connector: str, epoch: int) -> Callable[[Event], bool]:
    return lambda e: (e["event"] == "effect" and e["context"]["connector_id"] == connector
                      and e["epoch"] == epoch and e["mailbox"] == "delivered")


def rows(conn: psycopg.Connection[Any], table: str, tenant: str) -> list[tuple[Any, ...]]:
    return conn.execute(f"SELECT connector_id, epoch FROM {table} WHERE tenant_id = %s "
                        "ORDER BY seq", (tenant,)).fetchall()


def test_killed_holder_is_fenced_everywhere(gateways: Gateways,
                                            admin: psycopg.Connection[Any]) -> None:
    started = time.monotonic()
    tenant = gateways.tenant
    identity = LeaseIdentity(tenant, "agent-1", "ledger")
    a = gateways.start("gw-a")
    a.wait_for(lambda e: e["event"] == "holding" and e["epoch"] == 1, "lease at epoch 1")
    b = gateways.start("gw-b")
    b.wait_for(lambda e: e["event"] == "waiting" and e["reason"] == "lease_held",
               "lease_held while gw-a holds the lease")
    a.wait_for(lambda e: e["event"] == "effect" and e["n"] >= 3, "three effects")

    a.proc.send_signal(signal.SIGKILL)
    assert a.proc.wait(10) == -signal.SIGKILL
    killed_at = time.monotonic()
    a._reader.join(10)
    last = a.effects()[-1]
    assert last["epoch"] == 1 and last["mailbox"] == "delivered"

    # The survivor waits out the lease (it may not preempt) and takes over at epoch 2.
    taken = b.wait_for(lambda e: e["event"] == "holding", "takeover")
    assert taken["epoch"] == 2
    b.wait_for(effect_is("gw-b", 2), "an effect at epoch 2")
    assert time.monotonic() - killed_at > TTL / 2  # not before gw-a's lease had lapsed

    # gw-a's leftover work, replayed by another process exactly as gw-a would do it.
    replayed = subprocess.run(
        [sys.executable, str(GATEWAY), "replay", "--dsn", gateways.dsn, "--key-hex",
         KEY.hex(), "--effect-json", json.dumps(last)],
        capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(replayed.stdout.splitlines()[-1]) == {
        "event": "replayed", "ledger": "refused:stale_epoch", "mailbox": "refused:stale_epoch"}

    # And directly against the two boundaries, from its context and its token.
    token = parse_token(last["token"], key=KEY)
    assert (token.identity, token.epoch) == (identity, 1)
    with psycopg.connect(gateways.dsn) as conn:
        with pytest.raises(FencedEffectRefused) as refused, \
                fenced_transaction(conn, token, scopes=["ledger:write"]) as cur:
            cur.execute("INSERT INTO example.ledger (tenant_id, connector_id, epoch, n) "
                        "VALUES (%s, 'gw-a', 1, -1)", (tenant,))
        assert refused.value.reason is Reason.STALE_EPOCH
        guard = PostgresResourceGuard(conn)
        decision = guard.admit(f"mailbox/{identity}", token)
        assert (decision.reason, decision.highest_epoch) == (FenceReason.STALE_EPOCH, 2)
    # Nor can it forge its way past: the mailbox shares the signing key, gw-a's remains
    # do not, and an unsigned or re-signed token with a raised epoch is rejected.
    forged = FencingToken(identity, "gw-a", token.lease_id, 3, token.expires_at)
    for text in (format_token(forged), format_token(forged, key=b"x" * 32)):
        with pytest.raises(InvalidInput):
            parse_token(text, key=KEY)

    # The history: every effect in epoch order, gw-a's strictly before gw-b's, and nothing
    # the replays tried.
    for table in ("example.ledger", "example.mailbox"):
        history = rows(admin, table, tenant)
        epochs = [epoch for _, epoch in history]
        assert epochs == sorted(epochs), table
        assert {(c, e) for c, e in history} == {("gw-a", 1), ("gw-b", 2)}, table
    assert admin.execute("SELECT count(*) FROM example.ledger WHERE tenant_id = %s "
                            "AND n < 0", (tenant,)).fetchone() == (0,)
    reported = {e["ledger_seq"] for e in a.effects()}
    stored = {seq for (seq,) in admin.execute(
        "SELECT seq FROM example.ledger WHERE tenant_id = %s AND epoch = 1", (tenant,))}
    assert reported <= stored  # every effect gw-a reported is there (maybe one more: no
    assert len(stored - reported) <= 1  # exactly-once; it may have died before printing)

    # A clean stop releases the lease.
    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(10) == 0
    # Connected as the gateway role, neither gateway held privileges it never uses.
    for gateway in (a, b):
        assert "privileges it never uses" not in gateway.stderr_path.read_text()
    released = admin.execute(
        "SELECT epoch, released_at IS NOT NULL FROM mos_lease.logical_agent_connector_leases "
        "WHERE tenant_id = %s", (tenant,)).fetchone()
    assert released == (2, True)
    assert time.monotonic() - started < 30
