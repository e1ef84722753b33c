"""The adapter SDK: what a connector adapter implements and how a gateway runs one.

An adapter turns a validated invocation into harness-native work (a tmux keystroke, a Claude
or Codex API call, a Matrix message). It receives exactly two things:

* the :class:`~mos_lease.context.ConnectorExecutionContext` of a grant that was validated
  against the store immediately before the call. This is the *only* lease-derived input: an
  adapter never sees a grant, a lease handle, a coordinator or a store, so it cannot mint,
  renew or widen anything, and everything it needs for fencing (identity, connector, lease
  UUID, epoch, scopes, expiry, correlation id) is in the context;
* its own ``request``: what to do, in the adapter's own type (a command line, a prompt).
  This is not lease data and not a harness-native schema leaking into the gateway: the type
  belongs to the adapter. Taking it as a second argument, rather than baking it into a
  closure per call, lets one adapter object serve every call and keeps the rule checkable
  by a type checker: the first argument is a context and nothing else.

The adapter must carry the epoch to every downstream effect boundary (see
:func:`mos_lease.token.format_token` and :mod:`mos_lease.fencing`): gateway validation alone
cannot stop a connector validated a moment before a takeover from acting a moment after it.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol, TypeVar

from mos_lease.checks import check_async_adapter
from mos_lease.context import ConnectorExecutionContext
from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator
from mos_lease.grants import ExecutionGrant
from mos_lease.identity import LeaseIdentity
from mos_lease.results import InvocationResult

Req_contra = TypeVar("Req_contra", contravariant=True)
Res_co = TypeVar("Res_co", covariant=True)
Req = TypeVar("Req")
Res = TypeVar("Res")


class ConnectorAdapter(Protocol[Req_contra, Res_co]):
    """A synchronous adapter: ``execute`` runs only with a freshly validated context."""

    def execute(self, context: ConnectorExecutionContext, request: Req_contra, /) -> Res_co:
        """Do the work ``request`` asks for, for the lease ``context`` describes; carry
        ``context.epoch`` (or a token made from it) to every effect boundary."""


class AsyncConnectorAdapter(Protocol[Req_contra, Res_co]):
    """An asyncio adapter (``async def execute``)."""

    def execute(self, context: ConnectorExecutionContext, request: Req_contra,
                /) -> Awaitable[Res_co]:
        """As :meth:`ConnectorAdapter.execute`, returning an awaitable."""


def run_adapter(coordinator: ConnectorLeaseCoordinator, grant: ExecutionGrant,
                adapter: ConnectorAdapter[Req, Res], request: Req, *,
                identity: LeaseIdentity, scopes: object,
                correlation_id: str | None = None) -> InvocationResult[Res]:
    """Validate ``grant`` for ``identity`` and ``scopes``, then run ``adapter`` on ``request``.

    Goes through :meth:`ConnectorLeaseCoordinator.invoke`, so the adapter runs only if the
    store confirms the lease right now, and receives the context and nothing else. A refusal
    comes back as ``InvocationResult.reason``; the adapter's own exceptions propagate.
    """
    return coordinator.invoke(grant, lambda context: adapter.execute(context, request),
                              identity=identity, scopes=scopes, correlation_id=correlation_id)


async def run_adapter_async(coordinator: AsyncConnectorLeaseCoordinator, grant: ExecutionGrant,
                            adapter: AsyncConnectorAdapter[Req, Res], request: Req, *,
                            identity: LeaseIdentity, scopes: object,
                            correlation_id: str | None = None) -> InvocationResult[Res]:
    """The asyncio twin of :func:`run_adapter`. ``adapter.execute`` must be a coroutine
    function: a synchronous adapter is refused here, before the grant is read (as
    :meth:`~mos_lease.AsyncConnectorLeaseCoordinator.invoke` refuses one)."""
    check_async_adapter(getattr(adapter, "execute", None))

    async def call(context: ConnectorExecutionContext) -> Res:
        return await adapter.execute(context, request)

    return await coordinator.invoke(grant, call, identity=identity, scopes=scopes,
                                    correlation_id=correlation_id)
