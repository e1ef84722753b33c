"""A planned hand-off of one binding on PostgreSQL, in real time, with notices: a thread
supervisor running the binding as ``claude`` hands it to ``codex`` (another supervisor, or a
``hold()``, each with its own connection and notice listener); the successor takes the lease
over at the next epoch as the release notice arrives, well before its own next look would
have come; the audit log names the successor; the old connector's grant is refused
``stale_epoch`` at the gateway and by a fenced effect in the database, and the old holder
reports ``Moved``, never a loss, and does not take the binding back. Then the same back and
forth between two gateway processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity, Reason, hold
from mos_lease.fencing import FencedEffectRefused
from mos_lease.keep.handover import HANDOVER_PREFIX
from mos_lease.keep.timing import KeeperTiming
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.supervisor import BindingLost, BindingStarted, Change, Moved, Supervisor
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome
from mos_lease_pg import LeaseNotices
from mos_lease_pg.effects import fenced_transaction
from tests.handover_member import BINDING
from tests.pg.test_fencing import effects, notes, write_note
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

__all__ = ["effects"]  # the fixture, used by name

TTL = 6.0
RUN = ["tool:run"]
NEXT_LOOK = KeeperTiming(TTL).max_backoff  # when a successor without notices looks again


class Gateways:
    """Supervisors over one binding, each with its own store connection and listener."""

    def __init__(self, stores: StoreFactory, dsn: str, stack: ExitStack) -> None:
        self.stores, self.dsn, self.stack = stores, dsn, stack
        self.changes: dict[str, list[Change]] = {}
        self.reader = ConnectorLeaseCoordinator(stores(), AllowAllPolicy())

    def notices(self) -> LeaseNotices:
        notices = self.stack.enter_context(LeaseNotices(self.dsn, confirmer=NoticeConfirmer()))
        assert notices.listening.wait(5), notices.refused
        return notices

    def supervisor(self, name: str) -> Supervisor:
        changes = self.changes.setdefault(name, [])
        supervisor = Supervisor(ConnectorLeaseCoordinator(self.stores(), AllowAllPolicy()),
                                notices=self.notices(), on_change=changes.append)
        self.stack.callback(supervisor.close)
        return supervisor

    def audit(self, identity: LeaseIdentity) -> list[Any]:
        return [r.entry for r in self.reader.store.audit(identity)]  # type: ignore[attr-defined]


def wait_for(check: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``check()`` held (fails after ``timeout``)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.002)
    return time.monotonic() - start


@pytest.fixture
def gateways(pg_stores: StoreFactory, pg_dsn: str) -> Iterator[Gateways]:
    with ExitStack() as stack:
        yield Gateways(pg_stores, pg_dsn, stack)


def test_a_hand_off_to_another_supervisor_fences_the_old_connector(
        gateways: Gateways, pg_tenant: str, pg_dsn: str, effects: str) -> None:
    agent = LeaseIdentity(pg_tenant, "agent-1", "main")
    old = gateways.supervisor("claude")
    old.add(agent, "claude", scopes=RUN, ttl=TTL)
    wait_for(lambda: old.lease(agent) is not None, 10)
    held = old.lease(agent)
    assert held is not None
    grant = old.issue_grant(agent, scopes=RUN, ttl=10).grant
    assert grant is not None
    context = old.coordinator.validate(grant, identity=agent, scopes=RUN).context
    assert context is not None
    new = gateways.supervisor("codex")
    new.add(agent, "codex", scopes=RUN, ttl=TTL)
    wait_for(lambda: any(c.identity == agent for c in gateways.changes["codex"]), 5)

    called = time.monotonic()
    result = old.handover(agent, to="codex", drain=0)
    wait_for(lambda: new.lease(agent) is not None, 5)
    took = time.monotonic() - called
    assert result.ok and result.lease == held
    print(f"hand-off: the successor's lease {took * 1000:.1f} ms after the call")
    assert took < NEXT_LOOK / 2  # the release notice woke it, not its next look
    new_lease = new.lease(agent)
    assert new_lease is not None and (new_lease.connector_id, new_lease.epoch) == ("codex", 2)
    assert [c for c in gateways.changes["claude"] if c.identity == agent][:2] == [
        BindingStarted(agent, held), Moved(agent, held, "codex")]  # then, maybe, NewHolder
    assert isinstance(gateways.changes["codex"][-1], BindingStarted)

    rows = gateways.audit(agent)
    release = [e for e in rows if e.event is LifecycleEvent.RELEASE]
    assert [(e.outcome, e.correlation_id) for e in release] == [
        (Outcome.RELEASED, HANDOVER_PREFIX + "codex")]
    takeovers = [e for e in rows if e.event is LifecycleEvent.TAKEOVER]
    assert [(e.connector_id, e.outcome, e.epoch) for e in takeovers] == [
        ("codex", Outcome.TAKEN_OVER, 2)]

    # Downstream: the old connector's effect is refused from the new epoch on, the new
    # connector's admitted; at the gateway, the old grant is refused too.
    assert old.coordinator.validate(grant, identity=agent, scopes=RUN).reason \
        is Reason.STALE_EPOCH
    fresh = new.issue_grant(agent, scopes=RUN, ttl=10).grant
    assert fresh is not None
    new_context = new.coordinator.validate(fresh, identity=agent, scopes=RUN).context
    assert new_context is not None
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(FencedEffectRefused) as refused, \
                fenced_transaction(conn, context, scopes=RUN) as cur:
            write_note(cur, context, "old connector")
        assert refused.value.reason is Reason.STALE_EPOCH
        with fenced_transaction(conn, new_context, scopes=RUN) as cur:
            write_note(cur, new_context, "new connector")
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        assert notes(admin, pg_tenant) == [(2, "new connector")]

    time.sleep(0.5)  # the old holder leaves it be (its hold-off, then the lease is active)
    view = gateways.reader.current_holder(agent)
    assert view is not None and (view.connector_id, view.state) == ("codex", LeaseState.ACTIVE)
    assert not [c for c in gateways.changes["claude"] if isinstance(c, BindingLost)]


def test_a_hand_off_to_a_hold_of_the_named_connector(gateways: Gateways,
                                                      pg_tenant: str) -> None:
    agent = LeaseIdentity(pg_tenant, "agent-2", "main")
    old = gateways.supervisor("claude")
    old.add(agent, "claude", scopes=RUN, ttl=TTL)
    wait_for(lambda: old.lease(agent) is not None, 10)
    held: dict[str, Any] = {}
    entered = threading.Event()

    def successor() -> None:
        coordinator = ConnectorLeaseCoordinator(gateways.stores(), AllowAllPolicy())
        with hold(coordinator, agent, "codex", scopes=RUN, ttl=TTL,
                  notices=gateways.notices()) as holder:
            held["lease"] = holder.lease
            entered.set()
            time.sleep(0.3)

    waiter = threading.Thread(target=successor)
    waiter.start()
    time.sleep(0.3)  # the hold() waits: the lease is active
    assert not entered.is_set()
    called = time.monotonic()
    assert old.handover(agent, to="codex").ok  # no grant in flight: nothing to drain
    assert entered.wait(5)
    took = time.monotonic() - called
    waiter.join(5)
    print(f"hand-off to a hold(): {took * 1000:.1f} ms")
    assert took < NEXT_LOOK / 2
    assert (held["lease"].connector_id, held["lease"].epoch) == ("codex", 2)


def test_hand_offs_between_two_gateway_processes(pg_dsn: str, pg_tenant: str) -> None:
    """Real OS processes (``tests/handover_member.py``), each a supervisor with notices:
    the binding goes back and forth four times, each hand-off one release naming the
    successor and one takeover at the next epoch, and no process logs a WARNING."""
    root = Path(__file__).resolve().parents[2]
    gateways: dict[str, subprocess.Popen[str]] = {}

    def start(name: str) -> subprocess.Popen[str]:
        gateways[name] = subprocess.Popen(
            [sys.executable, "-m", "tests.handover_member", pg_dsn, pg_tenant, name, "6"],
            cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        return gateways[name]

    def said(name: str) -> str:
        stdout = gateways[name].stdout
        assert stdout is not None
        return stdout.readline().strip()

    try:
        start("h1")
        assert said("h1") == "started 1"
        start("h2")
        time.sleep(0.5)
        holder, successor = "h1", "h2"
        for epoch in range(2, 6):
            stdin = gateways[holder].stdin
            assert stdin is not None
            stdin.write(f"handover {successor}\n")
            stdin.flush()
            assert said(successor) == f"started {epoch}"  # within readline: no timeout
            assert said(holder) == "handed ok"
            holder, successor = successor, holder
    finally:
        ended = {}
        for name, process in gateways.items():
            ended[name] = process.communicate(timeout=30)
    agent = LeaseIdentity(pg_tenant, *BINDING)
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT outcome, epoch, connector_id, correlation_id FROM "
            "mos_lease.connector_lease_audit_log WHERE tenant_id = %s AND logical_agent_id "
            "= %s AND outcome <> 'renewed' ORDER BY seq",
            (agent.tenant_id, agent.logical_agent_id)).fetchall()
    handed = [(o, e, c, r if o == "released" else None) for o, e, c, r in rows][:9]
    assert handed == [("acquired", 1, "h1", None),
                      ("released", 1, "h1", "handover:h2"), ("taken_over", 2, "h2", None),
                      ("released", 2, "h2", "handover:h1"), ("taken_over", 3, "h1", None),
                      ("released", 3, "h1", "handover:h2"), ("taken_over", 4, "h2", None),
                      ("released", 4, "h2", "handover:h1"), ("taken_over", 5, "h1", None)]
    warnings = [line for _, err in ended.values() for line in err.splitlines()
                if " WARNING " in line and "privileges it never uses" not in line]
    assert warnings == []
