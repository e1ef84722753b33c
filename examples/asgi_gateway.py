"""An ASGI gateway (Starlette) that routes each binding's requests to the process holding it.

Run two or more of these against one database (``examples/README.md``)::

    python -m examples.asgi_gateway setup --dsn "$ADMIN_DSN"      # once, as a superuser
    python -m examples.asgi_gateway serve --config gw-a.json      # as the gateway role

Each process:

* in its **lifespan** builds one :class:`~mos_lease.AsyncConnectorLeaseCoordinator` over an
  :class:`~mos_lease_pg.AsyncPostgresLeaseStore` and one
  :class:`~mos_lease.supervisor.AsyncSupervisor`, and adds every binding of its configuration
  (:mod:`examples.recipes.config`) with its own endpoint as holder metadata; on shutdown it
  closes the supervisor, which releases every lease held;
* with ``"fleet"`` in its configuration, joins the supervisor to that fleet as member
  ``connector_id`` (``docs/fleet.md``): the processes share the bindings out, each handing
  over the ones the placement moves to another, and the process's one
  :class:`~mos_lease_pg.LeaseNotices` listener lets a successor take a binding over as its
  release is heard;
* serves ``POST /bindings/{name}/invoke``, one route per configured binding: if it holds the
  binding it issues a grant and runs the work under ``invoke`` (validation, then a fenced
  insert into ``recipes.effects``); if another process holds it, it forwards the request to
  the endpoint in ``current_holder().metadata`` (a real forward with ``http.client`` in a
  worker thread, at most ``max_hops`` times); an unknown name is ``404 unknown_binding``;
* serves ``GET /status``: each configured binding's ``current_holder()`` (read in batches
  of 1,000), and ``GET /fleet``: what the process sees of its fleet (no read of the store).

A request that names a tenant, agent, binding, connector, lease or epoch of its own (query
string, header or JSON body, in any spelling) is refused ``403 caller_identity`` before the
library sees it (:mod:`examples.recipes.screen` says exactly which names).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import attrs
import psycopg
import uvicorn
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

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
from mos_lease import AsyncConnectorLeaseCoordinator, StoreUnavailable
from mos_lease.adapter import run_adapter_async
from mos_lease.fencing import FencedEffectRefused
from mos_lease.supervisor import AsyncSupervisor
from mos_lease_pg import AsyncPostgresLeaseStore, LeaseNotices
from mos_lease_pg.effect_batches import CoalescedEffects

# Errors of the store or the effect's connection: the reply is 503 and nothing is served.
DOWN = (StoreUnavailable, psycopg.OperationalError, TimeoutError)




@attrs.define
class AsyncGateway:
    """What one process runs: its configuration, coordinator, supervisor, effect pool and
    the fenced effects written through it (coalesced: one per process)."""

    config: GatewayConfig
    store: AsyncPostgresLeaseStore
    coordinator: AsyncConnectorLeaseCoordinator
    supervisor: AsyncSupervisor
    notices: LeaseNotices
    pool: AsyncConnectionPool[Any]
    effects: CoalescedEffects

    @classmethod
    async def start(cls, config: GatewayConfig, dsn: str) -> AsyncGateway:
        """Connect, then campaign for every configured binding."""
        store = AsyncPostgresLeaseStore(dsn)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, min_size=1, max_size=4,
                                                             open=False)
        await pool.open(wait=True, timeout=30)
        # One coordinator for the process: grants are accepted only by the coordinator
        # that minted them (docs/gateway.md, "Threads, processes and stores").
        coordinator = AsyncConnectorLeaseCoordinator(store, config.policy())
        # One listener for the process: a release or takeover elsewhere is heard at once
        # (a fleet's successor takes a handed-over binding on its release's notice).
        notices = LeaseNotices(dsn)
        supervisor = AsyncSupervisor(coordinator, on_change=on_change, notices=notices,
                                     fleet=config.join())
        for binding in config.bindings:
            supervisor.add(binding.identity, config.connector_id, scopes=SCOPES,
                           ttl=config.ttl, clock_step=config.clock_step,
                           metadata=config.metadata)
        emit("started", connector_id=config.connector_id, endpoint=config.endpoint)
        return cls(config, store, coordinator, supervisor, notices, pool,
                   CoalescedEffects(pool))

    async def close(self) -> None:
        """Release every lease held (the supervisor's close), then disconnect."""
        try:
            await self.supervisor.close()
        finally:
            self.notices.close()
            await self.pool.close()
            await self.store.aclose()
            emit("stopped", connector_id=self.config.connector_id)

    async def invoke(self, binding: RouteBinding, work: Work) -> Refusal | Relayed | dict[
            str, object]:
        """Serve ``work`` here, forward it to the holder, or refuse it."""
        identity = binding.identity
        try:
            held = self.supervisor.lease(identity) is not None
            holder = None if held else await self.coordinator.current_holder(identity)
            where = route(self.config, held=held, holder=holder, hops=work.hops)
            if isinstance(where, Refusal):
                return where
            if isinstance(where, Forward):
                return await asyncio.to_thread(forward, where.endpoint, binding.name, work,
                                               where.hops, timeout=self.config.forward_timeout)
            granted = await self.supervisor.issue_grant(identity, scopes=SCOPES,
                                                        ttl=self.config.grant_ttl)
            if granted.grant is None:
                return grant_refused(granted)
            adapter: ledger.AsyncLedgerAdapter | ledger.AsyncValidateOnly = (
                ledger.AsyncLedgerAdapter(self.effects, binding.name)
                if self.config.work == "ledger" else ledger.AsyncValidateOnly())
            result = await run_adapter_async(self.coordinator, granted.grant, adapter,
                                             work.text, identity=identity, scopes=SCOPES)
        except FencedEffectRefused as refused:
            return fenced(refused.reason)
        except DOWN as down:
            return unavailable(down)
        if not result.ok or result.context is None:
            return invoke_refused(result.reason)
        return receipt(self.config, binding.name, result.context.epoch, result.value,
                       work.hops)

    async def status(self) -> dict[str, object]:
        """Each configured binding's holder, as the store shows it now, and the fleet."""
        holders = [holder for identities in batches(self.config.bindings)
                   for holder in await self.coordinator.current_holders(identities)]
        return status_json(self.config, holders,
                           lambda identity: self.supervisor.lease(identity) is not None,
                           self.supervisor.fleet_status())


def refusal_response(refusal: Refusal) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER)} if refusal.status == 503 else None
    return JSONResponse(refusal.body(), status_code=refusal.status, headers=headers)


async def read_body(request: Request) -> bytes | Refusal:
    """The body, never more than the screen accepts: a larger one is refused as soon as its
    Content-Length or its bytes pass the bound, without reading the rest."""
    declared = request.headers.get("content-length", "0")
    if not declared.isascii() or not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
        return too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return too_large()
    return bytes(body)


def build_app(config: GatewayConfig, dsn: str) -> Starlette:
    """The ASGI application: ``POST /bindings/{name}/invoke`` for each configured binding
    (any other name: ``404 unknown_binding``), ``GET /status`` and ``GET /fleet``."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[dict[str, Any]]:
        gateway = await AsyncGateway.start(config, dsn)
        try:
            yield {"gateway": gateway}
        finally:
            await gateway.close()

    async def invoke(request: Request) -> Response:
        # The name is looked up among the configured bindings (one dict lookup, however
        # many): the identity comes from the configuration, never from the request.
        name = request.path_params["name"]
        binding = config.binding(name)
        if binding is None:
            return refusal_response(unknown_binding(name))
        body = await read_body(request)
        work = body if isinstance(body, Refusal) else screen(
            request.url.query, request.headers.items(), body)
        if isinstance(work, Refusal):
            return refusal_response(work)
        gateway: AsyncGateway = request.state.gateway
        served = await gateway.invoke(binding, work)
        if isinstance(served, Refusal):
            return refusal_response(served)
        if isinstance(served, Relayed):
            return Response(served.body, status_code=served.status,
                            media_type="application/json")
        return JSONResponse(served)

    async def status(request: Request) -> Response:
        screened = screen(request.url.query, request.headers.items(), b"{}")
        if isinstance(screened, Refusal) and screened.reason == "caller_identity":
            return refusal_response(screened)
        gateway: AsyncGateway = request.state.gateway
        if request.url.path == "/fleet":
            return JSONResponse(fleet_json(config, gateway.supervisor.fleet_status()))
        try:
            return JSONResponse(await gateway.status())
        except DOWN as down:
            return refusal_response(unavailable(down))

    routes = [Route("/bindings/{name}/invoke", invoke, methods=["POST"]),
              Route("/status", status, methods=["GET"]),
              Route("/fleet", status, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan)



def serve(config: GatewayConfig, dsn: str) -> int:
    """Run the gateway on uvicorn until SIGTERM or SIGINT (a graceful stop, the lifespan's
    shutdown included)."""
    server = uvicorn.Server(uvicorn.Config(
        build_app(config, dsn), host=config.host, port=config.port, lifespan="on",
        log_level="warning", access_log=False))
    server.run()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    return command.run("asgi_gateway", "An ASGI gateway routing each binding's requests to "
                       "its lease holder.", argv, serve)


if __name__ == "__main__":
    sys.exit(main())
