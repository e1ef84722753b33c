"""End to end: the HTTP gateway recipes, two processes of each on one database.

``examples/asgi_gateway.py`` (Starlette on uvicorn) and ``examples/wsgi_gateway.py``
(wsgiref, a thread per request), as ``examples/README.md`` runs them: on a database after
``mos-lease setup``, the effect table made by ``setup`` as a superuser, both processes
connected as the gateway role, each configured with the same two bindings and its own
endpoint. For each kind: the first process holds both bindings, the second forwards to it
and each effect lands once under the holder's epoch; a request naming a tenant, agent,
binding, connector, lease or epoch of its own (in any spelling: ``X-Tenant-Name``,
``X-Mos-Lease-Epoch``, ``tenantName``, ...) is refused on both and writes nothing; the
holder is SIGKILLed, the survivor takes both bindings over once the ttl has run out and
serves the next requests; no effect row of the old epoch follows the takeover; a clean stop
releases the leases.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from examples.recipes.command import GC_THRESHOLDS
from tests.e2e.test_recipe_requests import MEANING_HEADERS
from tests.pg_fixtures import SetUpDatabase
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.pg]

ROOT = Path(__file__).resolve().parents[2]
TTL = 3.0
KINDS = ["asgi_gateway", "wsgi_gateway"]
# Seconds a gateway told to stop may take to end: a bound for a hung process, not a figure
# (a close waits at most 10 s for the supervisor's thread and 5 s for the listener's; it
# takes well under a second on a quiet machine, `bench/fleet.py` measures it).
STOP = 30.0
Reply = tuple[int, dict[str, Any]]


def call(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, path, body=body,
                     headers={"Content-Type": "application/json", **(headers or {})})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def post(port: int, name: str, fields: dict[str, Any], **headers: str) -> Reply:
    return call(port, "POST", f"/bindings/{name}/invoke", json.dumps(fields).encode(),
                {k.replace("_", "-"): v for k, v in headers.items()})


class GatewayProcess:
    """One gateway process, its output kept in files for the failure message."""

    def __init__(self, kind: str, dsn: str, connector_id: str, bindings: list[dict[str, str]],
                 log_dir: Path, **options: Any) -> None:
        self.name = connector_id
        self.port = free_port()
        config = log_dir / f"{connector_id}.json"
        config.write_text(json.dumps({
            "connector_id": connector_id, "endpoint": f"http://127.0.0.1:{self.port}",
            "ttl": TTL, "clock_step": 0, "bindings": bindings, **options}))
        self.out_path = log_dir / f"{connector_id}.out"
        self._out: IO[str] = self.out_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"examples.{kind}", "serve", "--dsn", dsn, "--config",
             str(config)], cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT, text=True)

    def status(self) -> dict[str, Any] | None:
        try:
            code, body = call(self.port, "GET", "/status")
        except OSError:
            return None
        return body if code == 200 else None

    def wait_status(self, check: Callable[[dict[str, Any]], bool], what: str,
                    timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if status is not None and check(status):
                return status
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: no {what}; last status {self.status()}; "
                             f"output:\n{self.out_path.read_text()[-3000:]}")

    def stopped(self, timeout: float = STOP) -> int:
        """The exit status, once the process has ended; one still running after ``timeout``
        seconds fails the test with every thread's stack (the recipes print them on
        SIGUSR1) and the end of its output."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            raise AssertionError(f"{self.name} still runs {timeout:g} s after the signal; "
                                 f"its threads and output:\n"
                                 f"{self.out_path.read_text()[-12000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._out.close()


def holders(status: dict[str, Any]) -> dict[str, tuple[str, int, str]]:
    return {b["name"]: (b["holder"]["connector_id"], b["holder"]["epoch"],
                        b["holder"]["state"]) for b in status["bindings"] if b["holder"]}


@pytest.fixture
def database(pg_set_up: SetUpDatabase) -> SetUpDatabase:
    done = subprocess.run([sys.executable, "-m", "examples.wsgi_gateway", "setup", "--dsn",
                           pg_set_up.admin_dsn], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    assert json.loads(done.stdout)["event"] == "set_up"
    return pg_set_up


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    processes: list[GatewayProcess] = []
    try:
        yield processes
    finally:
        for process in processes:
            process.close()


def effects(admin: psycopg.Connection[Any], tenant: str) -> list[tuple[Any, ...]]:
    return admin.execute(
        "SELECT seq, binding_name, connector_id, epoch, body FROM recipes.effects "
        "WHERE tenant_id = %s ORDER BY seq", (tenant,)).fetchall()


def refused_everywhere(ports: list[int], tenant: str) -> None:
    """Every way of naming an identity of the caller's own is refused on every process, and
    so is every malformed request; none of them writes anything."""
    for port in ports:
        forged = [
            (post(port, "ledger", {"text": "forged"}, X_Tenant_Id="other"), 403,
             "caller_identity"),
            (post(port, "ledger", {"text": "forged"}, X_Logical_Agent_Id="agent-9"), 403,
             "caller_identity"),
            (post(port, "ledger", {"text": "forged", "tenant_id": "other"}), 403,
             "caller_identity"),
            (post(port, "ledger", {"text": "forged", "logical_agent_id": "agent-9"}), 403,
             "caller_identity"),
            (post(port, "ledger", {"text": "forged", "binding_id": "mail"}), 403,
             "caller_identity"),
            (call(port, "POST", f"/bindings/ledger/invoke?tenant_id={tenant}",
                  b'{"text": "forged"}'), 403, "caller_identity"),
            (call(port, "GET", "/status?agent_id=agent-9"), 403, "caller_identity"),
            # Names that mean an identity, whatever their prefix or suffix.
            *[(call(port, "POST", "/bindings/ledger/invoke", b'{"text": "forged"}',
                    {header: "other"}), 403, "caller_identity") for header in MEANING_HEADERS],
            (call(port, "GET", "/status", headers={"X-Lease-Epoch": "9"}), 403,
             "caller_identity"),
            (call(port, "POST", "/bindings/ledger/invoke?tenantName=other",
                  b'{"text": "forged"}'), 403, "caller_identity"),
            (call(port, "POST", "/bindings/ledger/invoke?x-mos-lease-hops=0",
                  b'{"text": "forged"}'), 403, "caller_identity"),
            (post(port, "ledger", {"text": "forged", "mosLeaseEpoch": 3}), 403,
             "caller_identity"),
            (post(port, "ledger", {"text": "forged", "agentName": "agent-9"}), 403,
             "caller_identity"),
            # A route names a configured binding, never a tenant or an agent.
            (post(port, tenant, {"text": "forged"}), 404, "unknown_binding"),
            (post(port, "agent-1", {"text": "forged"}), 404, "unknown_binding"),
            (post(port, "ledger", {"text": "forged", "note": 1}), 400, "unknown_field"),
            (post(port, "ledger", {"text": 7}), 400, "invalid_text"),
            (post(port, "ledger", {"text": ""}), 400, "invalid_text"),
            (call(port, "POST", "/bindings/ledger/invoke", b""), 400, "invalid_body"),
            (call(port, "POST", "/bindings/ledger/invoke", b"[1]"), 400, "invalid_body"),
            (call(port, "POST", "/bindings/ledger/invoke", b"x" * 20_000), 413,
             "body_too_large"),
        ]
        for (code, body), expected_code, reason in forged:
            assert (code, body.get("error")) == (expected_code, reason), (port, body)


def until_served(port: int, killed_at: float) -> tuple[list[tuple[int, str]], dict[str, Any]]:
    """Until the dead holder's lease runs out, the survivor cannot serve (the holder does not
    answer, the binding has no holder for a moment, or the survivor's takeover is committed
    but not yet recorded by its supervisor); then it takes over and serves. Every answer and
    the first reply served."""
    answers: list[tuple[int, str]] = []
    while True:
        code, body = post(port, "ledger", {"text": f"after-{len(answers)}"})
        answers.append((code, body.get("error") or body["served_by"]))
        if code == 200:
            return answers, body
        assert code == 503 and body["error"] in {"holder_unreachable", "no_holder",
                                                 "not_held_here"}, body
        assert time.monotonic() < killed_at + 20, answers[-5:]
        time.sleep(0.2)


def check_history(rows: list[tuple[Any, ...]], *, served_after: int) -> None:
    """No effect of the old epoch after the takeover, and the refused requests wrote
    nothing: of the requests after the kill, only the one served and the next are there."""
    for name in ("ledger", "mail"):
        epochs = [epoch for _, bound, _, epoch, _ in rows if bound == name]
        assert epochs == sorted(epochs) and epochs[-1] == 2, (name, rows)
    assert {(c, e) for _, _, c, e, _ in rows} == {("gw-a", 1), ("gw-b", 2)}
    written = [text for *_, text in rows]
    assert "forged" not in written and "looping" not in written
    assert [t for t in written if t.startswith("after-")] == [f"after-{served_after}",
                                                              "after-mail"]


@pytest.mark.parametrize("kind", KINDS)
def test_two_gateways_route_refuse_and_take_over(
        kind: str, database: SetUpDatabase, pg_tenant: str, tmp_path: Path,
        started: list[GatewayProcess]) -> None:
    began = time.monotonic()
    tenant = pg_tenant
    bindings = [{"name": "ledger", "tenant_id": tenant, "logical_agent_id": "agent-1",
                 "binding_id": "ledger"},
                {"name": "mail", "tenant_id": tenant, "logical_agent_id": "agent-2",
                 "binding_id": "mail"}]
    a = GatewayProcess(kind, database.gateway_dsn, "gw-a", bindings, tmp_path)
    started.append(a)
    a.wait_status(lambda s: all(b["held_here"] for b in s["bindings"]), "both bindings held")
    b = GatewayProcess(kind, database.gateway_dsn, "gw-b", bindings, tmp_path)
    started.append(b)
    seen = b.wait_status(lambda s: holders(s) == {"ledger": ("gw-a", 1, "active"),
                                                  "mail": ("gw-a", 1, "active")},
                         "gw-a as the holder")
    assert not any(entry["held_here"] for entry in seen["bindings"])
    assert seen["bindings"][0]["holder"]["metadata"] == {"endpoint": f"http://127.0.0.1:{a.port}"}

    # Served by the holder, whichever process is asked: gw-b forwards (one hop).
    replies = {}
    for port, name, text in [(b.port, "ledger", "via-b-1"), (a.port, "ledger", "via-a-1"),
                             (b.port, "mail", "via-b-2"), (b.port, "ledger", "via-b-3")]:
        # A client's User-Agent says "agent" but names none: it is taken, as curl's is.
        code, body = post(port, name, {"text": text}, User_Agent="curl/8.5.0")
        assert code == 200, body
        assert (body["served_by"], body["epoch"], body["binding"]) == ("gw-a", 1, name)
        assert body["hops"] == (1 if port == b.port else 0)
        replies[text] = body["seq"]
    # The hop limit: a request forwarded twice already is not forwarded again.
    code, body = post(b.port, "ledger", {"text": "looping"}, X_Mos_Lease_Hops="2")
    assert (code, body["error"]) == (508, "hop_limit")
    refused_everywhere([a.port, b.port], tenant)

    with psycopg.connect(database.admin_dsn, autocommit=True) as admin:
        rows = effects(admin, tenant)
        # Each effect landed once, under the holder's epoch.
        assert sorted((body, seq) for seq, _, _, _, body in rows) == sorted(
            (text, seq) for text, seq in replies.items())
        assert {(c, e) for _, _, c, e, _ in rows} == {("gw-a", 1)}

        a.proc.send_signal(signal.SIGKILL)
        assert a.proc.wait(10) == -signal.SIGKILL
        killed_at = time.monotonic()

        answers, body = until_served(b.port, killed_at)
        assert (body["served_by"], body["epoch"], body["hops"]) == ("gw-b", 2, 0)
        assert time.monotonic() - killed_at > TTL / 2, answers  # not before the lease lapsed
        assert answers[0] == (503, "holder_unreachable")
        taken = b.wait_status(lambda s: holders(s) == {"ledger": ("gw-b", 2, "active"),
                                                        "mail": ("gw-b", 2, "active")},
                              "gw-b holding both at epoch 2", timeout=10)
        assert all(entry["held_here"] for entry in taken["bindings"])
        code, body = post(b.port, "mail", {"text": "after-mail"})
        assert (code, body["served_by"], body["epoch"]) == (200, "gw-b", 2), body
        refused_everywhere([b.port], tenant)

        check_history(effects(admin, tenant), served_after=len(answers) - 1)

        # A clean stop releases both leases. (uvicorn re-raises the signal once its
        # graceful shutdown, the lifespan's included, is over: it ends by SIGTERM.)
        b.proc.send_signal(signal.SIGTERM)
        assert b.stopped() in {0, -signal.SIGTERM}
        assert '"event": "stopped"' in b.out_path.read_text(), b.out_path.read_text()[-3000:]
        released = admin.execute(
            "SELECT binding_id, epoch, released_at IS NOT NULL FROM "
            "mos_lease.logical_agent_connector_leases WHERE tenant_id = %s ORDER BY 1",
            (tenant,)).fetchall()
        assert released == [("ledger", 2, True), ("mail", 2, True)]
    assert time.monotonic() - began < 60


def test_a_gateway_serves_with_the_recipes_collector_thresholds(tmp_path: Path) -> None:
    # The recipes' gateways keep thousands of bindings: run() sets GC_THRESHOLDS before it
    # serves (docs/fleet.md says why). In a process of its own, so this one keeps its own.
    config = tmp_path / "gw.json"
    config.write_text(json.dumps({
        "connector_id": "gw-1", "endpoint": "http://127.0.0.1:1", "ttl": TTL,
        "bindings": [{"name": "ledger", "tenant_id": "t", "logical_agent_id": "agent-1",
                      "binding_id": "main"}]}))
    script = (
        "import gc, sys\n"
        "from examples.recipes import command\n"
        "before = gc.get_threshold()\n"
        "def serve(config, dsn):\n"
        "    print(before, gc.get_threshold(), config.connector_id)\n"
        "    return 0\n"
        "sys.exit(command.run('gw', 'test', ['serve', '--dsn', 'x', '--config', sys.argv[1]],"
        " serve))\n")
    done = subprocess.run([sys.executable, "-c", script, str(config)], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"(700, 10, 10) {GC_THRESHOLDS} gw-1", done.stdout


def test_the_threaded_gateway_stops_on_a_signal_another_thread_received() -> None:
    # The kernel may deliver a process's SIGTERM to any of its threads; Python runs the
    # handler in the main thread only once that thread is back in the interpreter. Here the
    # signal is sent to a thread that is not the main one, as happens to a WSGI gateway
    # whose request threads are busy: the main thread waiting for the stop must still stop.
    script = (
        "import signal, threading, time\n"
        "from examples.recipes import command\n"
        "stop = command.stop_on_signals()\n"
        "def poke():\n"
        "    time.sleep(0.2)\n"
        "    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)\n"
        "threading.Thread(target=poke).start()\n"
        "command.wait_for_stop(stop)\n"
        "print('stopped', flush=True)\n")
    try:
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=False,
                              capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        raise AssertionError("the main thread never ran the SIGTERM handler") from None
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"
