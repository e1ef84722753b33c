"""A gateway's requests end to end: the ASGI recipe against a plain app, real processes.

    python bench/gateway_requests.py [--bindings 2000] [--clients 64] [--seconds 6] [--rounds 3]

Finds PostgreSQL as the tests do and works in a throwaway database. Four uvicorn processes
serve on loopback, each on its own port, side by side for the whole run:

* the ASGI gateway recipe (``examples/asgi_gateway.py``), holding ``--bindings`` bindings
  (``"generate"``), with ``"work": "validate"``: per request a grant issued through its
  ``AsyncSupervisor`` (one audited write, shared by the requests that overlap), then
  ``invoke``: the grant validated against the lease row, then the adapter;
* the same with ``"work": "ledger"``: the adapter also writes one row into
  ``recipes.effects`` as a fenced effect (``CoalescedEffects``: the inserts of overlapping
  requests share a transaction, each checked against its own lease row in it);
* a plain Starlette app doing per request what a gateway without this library would do
  durably: read the binding's row, insert one audit row, commit (one transaction), on a pool
  of as many connections as the gateway serves requests with (its store's one and its
  pool's four; its notice listener's connection only listens);
* the same plain app also inserting the effect row in that transaction.

``--clients`` keep-alive HTTP/1.1 connections (asyncio, in this process) post ``{"text":
...}`` to a binding drawn at random per request. Each round measures every server for
``--seconds`` in turn (the order rotates by round); a ratio is the median over rounds of the
round's gateway rate over the plain app's:

* ``gateway_requests_vs_plain_app``: validate-only gateway over the plain app;
* ``gateway_effect_requests_vs_plain_app``: with the fenced insert, over the plain app with
  the same insert.

Every reply must be ``200`` and every effect the gateway reported must be in the table
(exit status 3 otherwise). Absolute rates on a shared 2-core machine are noise: client,
servers and PostgreSQL share the cores; the ratios are measured side by side. Exit status:
0 ran, 2 could not run, 3 a correctness check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (the repository's own mos_lease, before anything imports it)
import attrs
import psycopg
from common import BenchError, CorrectnessError, failed, server, throwaway_database

from examples.recipes import ledger

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"gateway_requests_vs_plain_app": 0.8, "gateway_effect_requests_vs_plain_app": 0.8}
POOL = 5  # the gateway's connections: its store's dedicated one and its effect pool's four
TENANTS = 20
TTL = 30  # seconds: renewals every ~10 s, a small, equal background for every block
BODY = json.dumps({"text": "benchmark"}).encode()
PLAIN_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS plain;
CREATE TABLE IF NOT EXISTS plain.bindings (
    name text PRIMARY KEY, tenant_id text NOT NULL, logical_agent_id text NOT NULL,
    binding_id text NOT NULL);
CREATE TABLE IF NOT EXISTS plain.audit (
    seq bigserial PRIMARY KEY, name text NOT NULL, event text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


@attrs.frozen
class Size:
    bindings: int = 2000
    clients: int = 64
    seconds: float = 6.0
    rounds: int = 3
    warmup: float = 2.0


QUICK = Size(bindings=200, clients=16, seconds=1.0, rounds=1, warmup=0.5)


# --- the plain app (its own process: ``gateway_requests.py --serve-plain PORT``) -----------


def plain_app(dsn: str, effect: bool) -> Any:
    """A Starlette app that reads the binding's row, appends an audit row and (with
    ``effect``) the effect row, in one transaction per request."""
    from psycopg_pool import AsyncConnectionPool
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, min_size=POOL, max_size=POOL,
                                                         open=False)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await pool.open(wait=True, timeout=30)
        try:
            yield
        finally:
            await pool.close()

    async def invoke(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("text"), str):
            return JSONResponse({"error": "invalid_body"}, status_code=400)
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute("SELECT tenant_id, logical_agent_id, binding_id "
                                     "FROM plain.bindings WHERE name = %s", (name,))
            row = await cur.fetchone()
            if row is None:
                return JSONResponse({"error": "unknown_binding"}, status_code=404)
            await conn.execute("INSERT INTO plain.audit (name, event) VALUES (%s, 'invoke')",
                               (name,))
            seq = None
            if effect:
                cur = await conn.execute(ledger.INSERT, (name, *row, "plain", 1, body["text"]))
                inserted = await cur.fetchone()
                seq = None if inserted is None else inserted[0]
        return JSONResponse({"binding": name, "seq": seq})

    return Starlette(routes=[Route("/bindings/{name}/invoke", invoke, methods=["POST"])],
                     lifespan=lifespan)


def serve_plain(dsn: str, port: int, effect: bool) -> int:
    import uvicorn

    uvicorn.run(plain_app(dsn, effect), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, lifespan="on")
    return 0


# --- setting up and starting the servers -------------------------------------------------


def names(bindings: int) -> list[str]:
    """The binding names ``"generate"`` makes for ``bindings`` over :data:`TENANTS`."""
    agents = bindings // TENANTS
    return [f"t{i}-a{j}" for i in range(TENANTS) for j in range(agents)]


def prepare(dsn: str, bindings: int) -> None:
    """The effect table (as the recipes' ``setup`` makes it) and the plain app's tables."""
    agents = bindings // TENANTS
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ledger.SCHEMA)
        conn.execute(PLAIN_SCHEMA)
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO plain.bindings VALUES (%s, %s, %s, %s)",
                            [(f"t{i}-a{j}", f"tenant-{i}", f"agent-{j}", "plain")
                             for i in range(TENANTS) for j in range(agents)])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@attrs.define
class Server:
    """One server process on loopback: its name, port and process."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    connector_id: str | None = None  # a gateway's: how its held leases are counted

    def stop(self) -> None:
        # The database is thrown away afterwards: nothing needs releasing.
        self.proc.kill()
        self.proc.wait(timeout=10)


def start_gateway(dsn: str, work: str, size: Size, folder: Path) -> Server:
    port = free_port()
    connector = f"bench-gw-{work}"
    config = folder / f"{connector}.json"
    config.write_text(json.dumps({
        "connector_id": connector, "endpoint": f"http://127.0.0.1:{port}", "ttl": TTL,
        "work": work, "generate": {"tenants": TENANTS, "agents": size.bindings // TENANTS,
                                   "binding_id": f"bench-{work}"}}))
    log = (folder / f"{connector}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "examples.asgi_gateway", "serve", "--dsn",
                             dsn, "--config", str(config)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    return Server(f"gateway {work}", port, proc, connector)


def start_plain(dsn: str, effect: bool, folder: Path) -> Server:
    port = free_port()
    log = (folder / f"plain-{effect}.log").open("wb")
    proc = subprocess.Popen([sys.executable, __file__, "--serve-plain", str(port), "--dsn", dsn]
                            + (["--effect"] if effect else []), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    return Server(f"plain {'effect' if effect else 'read+audit'}", port, proc)


def wait_ready(servers: Sequence[Server], dsn: str, bindings: int, timeout: float) -> None:
    """Until every server accepts connections and every gateway holds all its bindings."""
    deadline = time.monotonic() + timeout
    for srv in servers:
        while True:
            if srv.proc.poll() is not None:
                raise BenchError(f"{srv.name} exited with {srv.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", srv.port), timeout=1):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"{srv.name} did not listen within {timeout} s")
            time.sleep(0.1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for srv in servers:
            while srv.connector_id is not None:
                row = conn.execute(
                    "SELECT count(*) FROM mos_lease.logical_agent_connector_leases "
                    "WHERE connector_id = %s AND released_at IS NULL "
                    "AND expires_at > clock_timestamp()", (srv.connector_id,)).fetchone()
                if row is not None and row[0] >= bindings:
                    break
                if time.monotonic() > deadline:
                    raise BenchError(f"{srv.name} held {row and row[0]} of {bindings} "
                                     f"bindings after {timeout} s")
                time.sleep(0.2)


# --- the clients ---------------------------------------------------------------------------


@attrs.frozen
class Block:
    """One server measured for a while: replies by status, rate and latencies."""

    statuses: dict[int, int]
    seconds: float
    latencies: list[float]

    @property
    def served(self) -> int:
        return self.statuses.get(200, 0)

    @property
    def rate(self) -> float:
        return self.served / self.seconds


async def _client(port: int, names: Sequence[str], until: float, statuses: dict[int, int],
                  latencies: list[float], rng: random.Random) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < until:
            name = names[rng.randrange(len(names))]
            started = time.perf_counter()
            writer.write(b"POST /bindings/%s/invoke HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (name.encode(), len(BODY), BODY))
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                key, _, value = line.partition(b":")
                if key.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _block(port: int, names: Sequence[str], clients: int, seconds: float,
                 seed: int) -> Block:
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    started = time.monotonic()
    until = started + seconds
    await asyncio.gather(*(_client(port, names, until, statuses, latencies,
                                   random.Random(seed * 1000 + k)) for k in range(clients)))
    return Block(statuses, time.monotonic() - started, latencies)


def measure(port: int, names: Sequence[str], clients: int, seconds: float,
            seed: int) -> Block:
    return asyncio.run(_block(port, names, clients, seconds, seed))


# --- the run -------------------------------------------------------------------------------


@attrs.frozen
class RequestsResult:
    blocks: dict[str, list[Block]]
    effects_checked: int

    def rate(self, name: str) -> float:
        return statistics.median(b.rate for b in self.blocks[name])

    def ratio(self, case: str, floor: str) -> float:
        return statistics.median(a.rate / b.rate for a, b in
                                 zip(self.blocks[case], self.blocks[floor], strict=True))

    def percentile(self, name: str, q: float) -> float:
        every = sorted(x for b in self.blocks[name] for x in b.latencies)
        return every[min(len(every) - 1, int(q * len(every)))] * 1000 if every else float("nan")

    def figures(self) -> dict[str, float]:
        return {
            "gateway_requests_vs_plain_app": self.ratio("gateway validate",
                                                        "plain read+audit"),
            "gateway_effect_requests_vs_plain_app": self.ratio("gateway ledger",
                                                               "plain effect"),
            "gateway_requests_per_s": self.rate("gateway validate"),
            "gateway_effect_requests_per_s": self.rate("gateway ledger"),
            "plain_app_requests_per_s": self.rate("plain read+audit"),
            "plain_app_effect_requests_per_s": self.rate("plain effect"),
        }

    def table(self) -> list[str]:
        lines = [f"{'server':<20} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}  replies"]
        for name, blocks in self.blocks.items():
            statuses: dict[int, int] = {}
            for block in blocks:
                for status, count in block.statuses.items():
                    statuses[status] = statuses.get(status, 0) + count
            lines.append(f"{name:<20} {self.rate(name):>9.0f} "
                         f"{self.percentile(name, 0.5):>8.1f} "
                         f"{self.percentile(name, 0.99):>8.1f}  {statuses}")
        return lines


def _check_effects(dsn: str, served: int) -> int:
    """The gateway's ledger rows: exactly one per request it answered 200."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM recipes.effects "
                           "WHERE connector_id = 'bench-gw-ledger'").fetchone()
    written = 0 if row is None else int(row[0])
    if written != served:
        raise CorrectnessError(f"the gateway answered {served} effects 200 but wrote "
                               f"{written} rows")
    return written


def run(size: Size, progress: Any = print) -> RequestsResult:
    srv = server()
    with throwaway_database(srv, "mos_lease_bench_requests") as dsn, \
            tempfile.TemporaryDirectory() as tmp:
        prepare(dsn, size.bindings)
        folder = Path(tmp)
        servers = [start_gateway(dsn, "validate", size, folder),
                   start_plain(dsn, False, folder),
                   start_gateway(dsn, "ledger", size, folder),
                   start_plain(dsn, True, folder)]
        try:
            progress(f"requests: starting 4 servers, the gateways taking {size.bindings} "
                     "bindings each")
            wait_ready(servers, dsn, size.bindings - size.bindings % TENANTS, timeout=120)
            keys = names(size.bindings)
            # Warm: connections, prepared statements; not counted, but every effect the
            # gateway answered 200 must be in the table, these too.
            warm = [measure(one.port, keys, size.clients, size.warmup, seed=-1 - k)
                    for k, one in enumerate(servers)]
            blocks: dict[str, list[Block]] = {one.name: [] for one in servers}
            for r in range(size.rounds):
                order = servers[r % len(servers):] + servers[:r % len(servers)]
                for one in order:
                    block = measure(one.port, keys, size.clients, size.seconds, seed=r)
                    progress(f"requests round {r + 1}: {one.name} {block.rate:.0f}/s "
                             f"{block.statuses}")
                    blocks[one.name].append(block)
            bad = {one.name: {s: n for b in [*blocks[one.name], warm[k]]
                              for s, n in b.statuses.items() if s != 200}
                   for k, one in enumerate(servers)}
            if any(bad.values()):
                raise CorrectnessError(f"replies other than 200: {bad}")
            checked = _check_effects(dsn, sum(b.served for b in blocks["gateway ledger"])
                                     + warm[2].served)
        finally:
            for one in servers:
                one.stop()
    return RequestsResult(blocks, checked)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    full = Size()
    parser.add_argument("--bindings", type=int, default=full.bindings)
    parser.add_argument("--clients", type=int, default=full.clients)
    parser.add_argument("--seconds", type=float, default=full.seconds)
    parser.add_argument("--rounds", type=int, default=full.rounds)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--serve-plain", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dsn", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--effect", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_plain is not None:
        return serve_plain(args.dsn, args.serve_plain, args.effect)
    size = QUICK if args.quick else Size(args.bindings, args.clients, args.seconds,
                                         args.rounds)
    try:
        result = run(size)
    except (BenchError, CorrectnessError) as error:
        return failed(error)
    print("\n".join(result.table()))
    figures = result.figures()
    for name, target in TARGETS.items():
        print(f"{name}: {figures[name]:.3f} (target >= {target}: "
              f"{'met' if figures[name] >= target else 'missed'})")
    print(f"effects checked: {result.effects_checked} rows, one per 200")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

