"""A threaded WSGI gateway (standard library only) that routes each binding's requests to
the process holding it: the synchronous twin of ``examples/asgi_gateway.py``.

Run two or more of these against one database (``examples/README.md``)::

    python -m examples.wsgi_gateway setup --dsn "$ADMIN_DSN"      # once, as a superuser
    python -m examples.wsgi_gateway serve --config gw-a.json      # as the gateway role

The server is :mod:`wsgiref` with :class:`socketserver.ThreadingMixIn`: a thread per
request. The process has **one** :class:`~mos_lease.ConnectorLeaseCoordinator`, shared by
every request thread, because grants are accepted only by the coordinator that minted them
(a coordinator per thread or per request would refuse them all, ``grant_unknown``). Its
store is a :class:`~mos_lease_pg.PostgresLeaseStore` on one dedicated connection: with the
database on the same host, that connection serves the threads' validations one round trip
at a time and a pool adds nothing; with a network in between, give it a pool sized to the
threads that validate at once (``PostgresLeaseStore(pool=make_pool(dsn, settings,
max_size=k))``); both measured in ``docs/gateway.md``, "Threads, processes and stores". One
:class:`~mos_lease.supervisor.Supervisor` thread campaigns for and renews every binding,
joined to the configuration's fleet if it names one. Routes, replies and refusals are the
ASGI gateway's (``examples/recipes``).
"""

from __future__ import annotations

import json
import socketserver
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import attrs
import psycopg
from psycopg_pool import ConnectionPool

from examples.recipes import command, ledger
from examples.recipes.command import emit, on_change
from examples.recipes.config import SCOPES, GatewayConfig, RouteBinding
from examples.recipes.forward import Relayed, forward
from examples.recipes.routing import (
    RETRY_AFTER,
    Forward,
    batches,
    fenced,
    fleet_json,
    grant_refused,
    invoke_refused,
    receipt,
    route,
    status_json,
    unavailable,
    unknown_binding,
)
from examples.recipes.screen import MAX_BODY_BYTES, Refusal, Work, screen, too_large
from mos_lease import ConnectorLeaseCoordinator, StoreUnavailable
from mos_lease.adapter import run_adapter
from mos_lease.fencing import FencedEffectRefused
from mos_lease.supervisor import Supervisor
from mos_lease_pg import LeaseNotices, PostgresLeaseStore

DOWN = (StoreUnavailable, psycopg.OperationalError, TimeoutError)
StartResponse = Callable[[str, list[tuple[str, str]]], object]
PREFIX, SUFFIX = "/bindings/", "/invoke"
REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 409: "Conflict", 413: "Content Too Large",
           502: "Bad Gateway", 503: "Service Unavailable", 508: "Loop Detected"}




@attrs.define
class ThreadGateway:
    """What one process runs: its configuration, coordinator, supervisor and effect pool."""

    config: GatewayConfig
    store: PostgresLeaseStore
    coordinator: ConnectorLeaseCoordinator
    supervisor: Supervisor
    notices: LeaseNotices
    pool: ConnectionPool[Any]

    @classmethod
    def start(cls, config: GatewayConfig, dsn: str) -> ThreadGateway:
        """Connect, then campaign for every configured binding."""
        store = PostgresLeaseStore(dsn)
        pool: ConnectionPool[Any] = ConnectionPool(dsn, min_size=1, max_size=4, open=False)
        pool.open(wait=True, timeout=30)
        coordinator = ConnectorLeaseCoordinator(store, config.policy())
        notices = LeaseNotices(dsn)  # one listener for the process, as in the ASGI recipe
        supervisor = Supervisor(coordinator, on_change=on_change, notices=notices,
                                fleet=config.join())
        for binding in config.bindings:
            supervisor.add(binding.identity, config.connector_id, scopes=SCOPES,
                           ttl=config.ttl, clock_step=config.clock_step,
                           metadata=config.metadata)
        emit("started", connector_id=config.connector_id, endpoint=config.endpoint)
        return cls(config, store, coordinator, supervisor, notices, pool)

    def close(self) -> None:
        """Release every lease held (the supervisor's close), then disconnect."""
        try:
            self.supervisor.close()
        finally:
            self.notices.close()
            self.pool.close()
            self.store.close()
            emit("stopped", connector_id=self.config.connector_id)

    def invoke(self, binding: RouteBinding, work: Work) -> Refusal | Relayed | dict[str, object]:
        """Serve ``work`` here, forward it to the holder, or refuse it."""
        identity = binding.identity
        try:
            held = self.supervisor.lease(identity) is not None
            holder = None if held else self.coordinator.current_holder(identity)
            where = route(self.config, held=held, holder=holder, hops=work.hops)
            if isinstance(where, Refusal):
                return where
            if isinstance(where, Forward):
                return forward(where.endpoint, binding.name, work, where.hops,
                               timeout=self.config.forward_timeout)
            granted = self.supervisor.issue_grant(identity, scopes=SCOPES,
                                                  ttl=self.config.grant_ttl)
            if granted.grant is None:
                return grant_refused(granted)
            adapter: ledger.LedgerAdapter | ledger.ValidateOnly = (
                ledger.LedgerAdapter(self.pool, binding.name) if self.config.work == "ledger"
                else ledger.ValidateOnly())
            result = run_adapter(self.coordinator, granted.grant, adapter, work.text,
                                 identity=identity, scopes=SCOPES)
        except FencedEffectRefused as refused:
            return fenced(refused.reason)
        except DOWN as down:
            return unavailable(down)
        if not result.ok or result.context is None:
            return invoke_refused(result.reason)
        return receipt(self.config, binding.name, result.context.epoch, result.value,
                       work.hops)

    def status(self) -> dict[str, object]:
        """Each configured binding's holder, as the store shows it now, and the fleet."""
        holders = [holder for identities in batches(self.config.bindings)
                   for holder in self.coordinator.current_holders(identities)]
        return status_json(self.config, holders,
                           lambda identity: self.supervisor.lease(identity) is not None,
                           self.supervisor.fleet_status())


def compact(body: object) -> bytes:
    """JSON as Starlette's ``JSONResponse`` writes it, so both recipes reply alike."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def headers_of(environ: dict[str, Any]) -> list[tuple[str, str]]:
    """The request's headers as (name, value), from the WSGI environ's ``HTTP_*`` keys."""
    return [(key[5:].replace("_", "-"), str(value)) for key, value in environ.items()
            if key.startswith("HTTP_")]


def read_body(environ: dict[str, Any]) -> bytes | Refusal:
    """The body, refused unread when its Content-Length is over the screen's bound."""
    declared = str(environ.get("CONTENT_LENGTH") or "0")
    if not declared.isascii() or not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
        return too_large()
    body: bytes = environ["wsgi.input"].read(int(declared))
    return body


def make_app(gateway: ThreadGateway) -> Callable[[dict[str, Any], StartResponse],
                                                 Iterable[bytes]]:
    """The WSGI application: ``POST /bindings/{name}/invoke`` for each configured binding
    (any other name: ``404 unknown_binding``), ``GET /status`` and ``GET /fleet``."""

    def reply(start_response: StartResponse, status: int, body: bytes) -> list[bytes]:
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        if status == 503:
            headers.append(("Retry-After", str(RETRY_AFTER)))
        start_response(f"{status} {REASONS.get(status, 'Error')}", headers)
        return [body]

    def refuse(start_response: StartResponse, refusal: Refusal) -> list[bytes]:
        return reply(start_response, refusal.status, compact(refusal.body()))

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "")
        query = environ.get("QUERY_STRING", "")
        if path in ("/status", "/fleet") and method == "GET":
            screened = screen(query, headers_of(environ), b"{}")
            if isinstance(screened, Refusal) and screened.reason == "caller_identity":
                return refuse(start_response, screened)
            if path == "/fleet":
                return reply(start_response, 200, compact(fleet_json(
                    gateway.config, gateway.supervisor.fleet_status())))
            try:
                return reply(start_response, 200, compact(gateway.status()))
            except DOWN as down:
                return refuse(start_response, unavailable(down))
        if not (path.startswith(PREFIX) and path.endswith(SUFFIX)):
            return refuse(start_response, Refusal(404, "not_found", "no such route"))
        if method != "POST":
            return refuse(start_response, Refusal(405, "method_not_allowed", "POST only"))
        name = path[len(PREFIX):-len(SUFFIX)]
        # The name is looked up among the configured bindings; the identity comes from
        # there, never from the request.
        binding = gateway.config.binding(name)
        if binding is None:
            return refuse(start_response, unknown_binding(name))
        body = read_body(environ)
        work = body if isinstance(body, Refusal) else screen(query, headers_of(environ), body)
        if isinstance(work, Refusal):
            return refuse(start_response, work)
        served = gateway.invoke(binding, work)
        if isinstance(served, Refusal):
            return refuse(start_response, served)
        if isinstance(served, Relayed):
            return reply(start_response, served.status, served.body)
        return reply(start_response, 200, compact(served))

    return app


class ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    """``wsgiref``'s server with a thread per request."""

    daemon_threads = True  # a request still running never holds up the process's exit


class QuietHandler(WSGIRequestHandler):
    """No access log line per request on stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(config: GatewayConfig, dsn: str) -> int:
    """Serve until SIGTERM or SIGINT, then release every lease and stop."""
    stop = command.stop_on_signals()
    gateway = ThreadGateway.start(config, dsn)
    try:
        server = make_server(config.host, config.port, make_app(gateway),
                             server_class=ThreadingWSGIServer, handler_class=QuietHandler)
        # serve_forever runs on a thread of its own: shutdown() waits for it to return, so
        # it cannot be called from the thread serving.
        serving = threading.Thread(target=server.serve_forever, name="wsgi-server")
        serving.start()
        command.wait_for_stop(stop)
        server.shutdown()
        serving.join()
        server.server_close()
    finally:
        gateway.close()
    return 0



def main(argv: list[str] | None = None) -> int:
    return command.run("wsgi_gateway", "A threaded WSGI gateway routing each binding's "
                       "requests to its holder.", argv, serve)


if __name__ == "__main__":
    sys.exit(main())
