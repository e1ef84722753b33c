"""The tmux adapter against a real tmux server on a private socket.

Without tmux (Debian package ``tmux``) the tests that drive it skip, naming the package; with
``MOS_LEASE_REQUIRE_TOOLS=1`` (CI) they fail instead (see ``tests/tools.py``).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    Reason,
)
from mos_lease.adapter import ConnectorAdapter, run_adapter
from mos_lease.clock import ManualClock
from mos_lease.fencing import FenceReason, GuardDecision
from mos_lease.token import FencingToken, parse_token
from mos_lease_memory import InMemoryLeaseStore
from mos_lease_memory.fencing import InMemoryResourceGuard
from mos_lease_tmux import TmuxError, TmuxPaneAdapter, TmuxSendResult, TmuxServer, check_command
from tests import tools

IDENT = LeaseIdentity("acme", "agent-1", "tmux-binding")
SCOPES = ("tmux:send",)
KEY = b"shared-with-the-pane-side-resource"
TOKEN_RE = re.compile(r"MOS_FENCE=(mlf1\.[A-Za-z0-9_.-]+);")


@attrs.define
class Pane:
    server: TmuxServer
    pane_id: str
    log: Path  # commands that must be checked in order append here: a screen can interleave
    # the echo of typed input with the output of commands still running

    def executed(self, count: int, timeout: float = 10.0) -> list[str]:
        """The first ``count`` lines the pane's commands appended to ``log``."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.log.read_text().splitlines() if self.log.exists() else []
            if len(lines) >= count:
                return lines
            if time.monotonic() > deadline:
                raise AssertionError(f"only {lines} executed; pane:\n{self.text()}")
            time.sleep(0.02)

    def text(self) -> str:
        return self.server.capture(self.pane_id)

    def wait_for(self, needle: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if needle in text:
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} never appeared in the pane:\n{text}")
            time.sleep(0.02)


@pytest.fixture
def pane() -> Iterator[Pane]:
    tools.need(tools.TMUX)
    base = Path(tempfile.mkdtemp(prefix="mlt-"))  # short: socket paths are limited
    server = TmuxServer(base / "sock")
    try:
        pane_id = server.new_session("fenced", ["/bin/sh"], width=250, height=60,
                                     env={"PS1": "$ ", "ENV": "", "HISTFILE": ""})
        yield Pane(server, pane_id, base / "log")
    finally:
        server.kill()
        shutil.rmtree(base, ignore_errors=True)


@attrs.define
class Gateways:
    clock: ManualClock
    a: ConnectorLeaseCoordinator
    b: ConnectorLeaseCoordinator


def gateways() -> Gateways:
    clock = ManualClock(datetime(2030, 1, 1, tzinfo=UTC))
    store = InMemoryLeaseStore(clock)
    return Gateways(clock, ConnectorLeaseCoordinator(store, AllowAllPolicy()),
                    ConnectorLeaseCoordinator(store, AllowAllPolicy()))


def lease(result_lease: LeaseHandle | None) -> LeaseHandle:
    assert result_lease is not None
    return result_lease


def test_only_the_current_connector_reaches_the_pane(pane: Pane) -> None:
    gw = gateways()
    adapter = TmuxPaneAdapter(pane.server, pane.pane_id, InMemoryResourceGuard(),
                              signing_key=KEY)
    typed: ConnectorAdapter[str, TmuxSendResult] = adapter  # the SDK protocol
    a_lease = lease(gw.a.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30).lease)
    a_grant = gw.a.issue_grant(a_lease, scopes=SCOPES, ttl=10).grant
    assert a_grant is not None
    first = run_adapter(gw.a, a_grant, typed, "echo alpha-$((6*7))", identity=IDENT,
                        scopes=SCOPES)
    assert first.ok and first.value is not None and first.value.sent
    a_context = first.context
    assert a_context is not None
    text = pane.wait_for("alpha-42")
    stamped = TOKEN_RE.findall(text)
    assert stamped == [first.value.token]
    assert parse_token(stamped[0], key=KEY).epoch == 1

    # conn-b preempts conn-a on the other gateway (this policy allows it): epoch 2, while
    # conn-a's grant has not even expired.
    gw.clock.advance(1)
    b_lease = lease(gw.b.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=30,
                                  expected_epoch=1).lease)
    b_grant = gw.b.issue_grant(b_lease, scopes=SCOPES, ttl=10).grant
    assert b_grant is not None
    second = run_adapter(gw.b, b_grant, adapter, "echo bravo-$((6*7))", identity=IDENT,
                         scopes=SCOPES)
    assert second.ok and second.value is not None and second.value.highest_epoch == 2
    pane.wait_for("bravo-42")

    # The stale connector, two ways. Through the gateway: refused before the adapter runs.
    called: list[ConnectorExecutionContext] = []

    def spy(context: ConnectorExecutionContext) -> None:
        called.append(context)

    refused = gw.a.invoke(a_grant, spy, identity=IDENT, scopes=SCOPES)
    assert refused.reason is Reason.STALE_EPOCH and called == []
    # Work it validated before the takeover and still tries now: refused at the pane.
    leftover = adapter.execute(a_context, "echo stale-$((6*7))")
    assert leftover == TmuxSendResult(False, FenceReason.STALE_EPOCH, 2, leftover.token)

    # The current holder goes on, and its commands see their own token.
    third = run_adapter(gw.b, b_grant, adapter, 'echo "charlie-$((6*7)) fence=$MOS_FENCE"',
                        identity=IDENT, scopes=SCOPES)
    assert third.ok and third.value is not None
    text = pane.wait_for("charlie-42 fence=")
    assert f"charlie-42 fence={third.value.token}" in text
    assert "stale" not in text
    assert [parse_token(t, key=KEY).epoch for t in TOKEN_RE.findall(text)] == [1, 2, 2]
    assert [parse_token(t, key=KEY).connector_id for t in TOKEN_RE.findall(text)] == [
        "conn-a", "conn-b", "conn-b"]


def test_racing_connectors_reach_the_pane_in_epoch_order(pane: Pane) -> None:
    """Two connectors, both holding contexts that passed validation, type at the same time:
    once a command of epoch 2 is in the pane, no command of epoch 1 follows it."""
    gw = gateways()
    a_lease = lease(gw.a.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30).lease)
    a_grant = gw.a.issue_grant(a_lease, scopes=SCOPES, ttl=10).grant
    assert a_grant is not None
    a_context = gw.a.validate(a_grant, identity=IDENT, scopes=SCOPES).context
    gw.clock.advance(31)
    b_lease = lease(gw.b.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=30,
                                  expected_epoch=1).lease)
    b_grant = gw.b.issue_grant(b_lease, scopes=SCOPES, ttl=10).grant
    assert b_grant is not None
    b_context = gw.b.validate(b_grant, identity=IDENT, scopes=SCOPES).context
    assert a_context is not None and b_context is not None

    # Two adapters (two gateways' worth) on one pane, sharing one guard.
    guard = InMemoryResourceGuard()
    adapters = [TmuxPaneAdapter(pane.server, pane.pane_id, guard) for _ in range(2)]
    start = threading.Barrier(2)
    results: dict[str, list[TmuxSendResult]] = {"a": [], "b": []}

    def send(name: str, adapter: TmuxPaneAdapter, context: ConnectorExecutionContext) -> None:
        start.wait()
        for n in range(12):
            results[name].append(adapter.execute(context, f"echo {name} {n} >> {pane.log}"))

    threads = [threading.Thread(target=send, args=("a", adapters[0], a_context)),
               threading.Thread(target=send, args=("b", adapters[1], b_context))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.sent for r in results["b"])
    sent_a = [n for n, r in enumerate(results["a"]) if r.sent]
    assert all(r.reason is FenceReason.STALE_EPOCH for r in results["a"] if not r.sent)
    executed = [line.split() for line in pane.executed(12 + len(sent_a))]
    assert len(executed) == 12 + len(sent_a)  # exactly what was sent, nothing refused
    assert [int(n) for w, n in executed if w == "a"] == sent_a
    assert [int(n) for w, n in executed if w == "b"] == list(range(12))
    order = [w for w, _ in executed]
    assert "a" not in order[order.index("b"):], order


class SlowAfterAdmit:
    """A guard that stalls after admitting epoch 1, like a sender descheduled between its
    admission and its keystrokes."""

    def __init__(self, inner: InMemoryResourceGuard) -> None:
        self.inner = inner
        self.stalled = threading.Event()

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        decision = self.inner.admit(resource_id, token)
        if token.epoch == 1:
            self.stalled.set()
            time.sleep(0.3)
        return decision


def test_admission_and_keystrokes_are_atomic(pane: Pane) -> None:
    """conn-a is admitted at epoch 1 and stalls; conn-b (epoch 2) tries meanwhile. conn-b
    must wait for conn-a's keystrokes, or conn-a's would land after an epoch-2 command."""
    gw = gateways()
    a_context = _context(gw)
    gw.clock.advance(31)
    b_lease = lease(gw.b.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=30,
                                  expected_epoch=1).lease)
    b_grant = gw.b.issue_grant(b_lease, scopes=SCOPES, ttl=10).grant
    assert b_grant is not None
    guard = SlowAfterAdmit(InMemoryResourceGuard())
    slow_a = TmuxPaneAdapter(pane.server, pane.pane_id, guard)
    b = TmuxPaneAdapter(pane.server, pane.pane_id, guard.inner)
    sender = threading.Thread(target=slow_a.execute, args=(a_context, f"echo a >> {pane.log}"))
    sender.start()
    assert guard.stalled.wait(5)
    sent = run_adapter(gw.b, b_grant, b, f"echo b >> {pane.log}", identity=IDENT,
                       scopes=SCOPES)
    sender.join()
    assert sent.ok
    assert pane.executed(2) == ["a", "b"]


def test_trailing_semicolons_arrive_intact(pane: Pane) -> None:
    gw = gateways()
    context = _context(gw)
    adapter = TmuxPaneAdapter(pane.server, pane.pane_id, InMemoryResourceGuard())
    assert adapter.execute(context, "echo semi-one;").sent
    assert adapter.execute(context, r"echo semi-two \;").sent
    text = pane.wait_for("semi-two ;\n")
    assert "echo semi-one;\n" in text
    assert "semi-one\n" in text


def test_bad_commands_are_refused_before_anything_is_admitted(pane: Pane) -> None:
    gw = gateways()
    guard = InMemoryResourceGuard()
    adapter = TmuxPaneAdapter(pane.server, pane.pane_id, guard)
    context = _context(gw)
    for bad in ["", "   ", "echo a\necho b", "echo\ttab", "echo \x03", "echo x \\",
                "x" * 4097, 42]:
        with pytest.raises(InvalidInput) as caught:
            adapter.execute(context, bad)  # type: ignore[arg-type]
        assert caught.value.field == "command"
    assert guard.state(adapter.resource_id) is None
    assert check_command("echo ünïcode ✓") == "echo ünïcode ✓"


def test_unknown_pane() -> None:
    tools.need(tools.TMUX)
    base = Path(tempfile.mkdtemp(prefix="mlt-"))
    try:
        with pytest.raises(TmuxError) as caught:
            TmuxPaneAdapter(TmuxServer(base / "sock"), "%99", InMemoryResourceGuard())
        # Refused by a real tmux, not for want of one.
        assert "install" not in str(caught.value)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_missing_binary() -> None:
    base = Path(tempfile.mkdtemp(prefix="mlt-"))
    try:
        with pytest.raises(TmuxError, match="apt-get install tmux"):
            TmuxServer(base / "sock", tmux="tmux-does-not-exist").run("ls")
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("require", [False, True])
def test_without_tmux_it_skips_naming_the_package_or_fails_when_required(require: bool) -> None:
    output = tools.run_without_tools(
        "tests/e2e/test_tmux_adapter.py::test_trailing_semicolons_arrive_intact", require=require)
    assert "tmux not installed (Debian: apt-get install tmux)" in output, output
    if require:
        assert "1 error" in output and "MOS_LEASE_REQUIRE_TOOLS is set" in output, output
    else:
        assert "1 skipped" in output and "error" not in output, output


def _context(gw: Gateways) -> ConnectorExecutionContext:
    handle = lease(gw.a.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30).lease)
    grant = gw.a.issue_grant(handle, scopes=SCOPES, ttl=10).grant
    assert grant is not None
    context = gw.a.validate(grant, identity=IDENT, scopes=SCOPES).context
    assert context is not None
    return context
