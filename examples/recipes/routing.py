"""Where a request for a binding goes: served here, forwarded to the holder, or refused.

A pure decision over what the gateway knows at that moment: whether its supervisor holds the
binding's lease, and the holder the store shows (``current_holder()``, whose metadata names
the holder's endpoint). The route is a hint like any read: the holder may change a moment
later, and fencing never depends on it. A request forwarded to a process that no longer
holds the binding is routed again there, up to the configured hop limit.
"""

from __future__ import annotations

import attrs

from examples.recipes.config import GatewayConfig, check_endpoint
from examples.recipes.screen import Refusal
from mos_lease.results import GrantResult, HolderView
from mos_lease.vocabulary import LeaseState

RETRY_AFTER = 1  # seconds: about the supervisor's backoff while it campaigns


@attrs.frozen
class Serve:
    """This process holds the binding: issue a grant and run the work here."""


@attrs.frozen
class Forward:
    """Another process holds the binding: send the request to its endpoint."""

    endpoint: str
    hops: int  # the hop count the forwarded request carries


def route(config: GatewayConfig, *, held: bool, holder: HolderView | None,
          hops: int) -> Serve | Forward | Refusal:
    """Where a request that has been forwarded ``hops`` times goes."""
    if held:
        return Serve()
    if holder is None or holder.state is not LeaseState.ACTIVE:
        return Refusal(503, "no_holder",
                       "no gateway holds this binding now; the supervisor is campaigning")
    if holder.connector_id == config.connector_id:
        # Our own connector id, but not our lease: a previous run of this process, whose
        # lease has yet to expire. Never forward to ourselves.
        return Refusal(503, "not_held_here",
                       "this gateway's previous lease has not expired yet")
    try:
        endpoint = check_endpoint("endpoint", holder.metadata.get("endpoint"))
    except ValueError:
        return Refusal(503, "holder_without_endpoint",
                       "the holder set no http://host:port endpoint in its metadata")
    if endpoint == config.endpoint:
        return Refusal(503, "not_held_here", "the holder's endpoint is this gateway's own")
    if hops >= config.max_hops:
        return Refusal(508, "hop_limit",
                       f"forwarded {hops} times already; the holder keeps moving")
    return Forward(endpoint, hops + 1)


def grant_refused(granted: GrantResult) -> Refusal:
    """The reply when this process held the binding a moment ago but no grant came."""
    return Refusal(503, str(granted.reason or "grant_refused"),
                   "the lease was lost before a grant could be issued; try again")


def invoke_refused(reason: object) -> Refusal:
    """The reply when validation refused the grant (the lease moved on in between)."""
    return Refusal(409, str(reason or "invoke_refused"),
                   "the grant was refused at validation; the effect was not written")


def fenced(reason: object) -> Refusal:
    """The reply when the fenced transaction refused the effect."""
    return Refusal(409, str(reason), "the lease moved on before the effect committed; "
                                     "nothing was written")


def unavailable(error: BaseException) -> Refusal:
    """The reply when the store cannot be reached (fail closed)."""
    return Refusal(503, "store_unavailable", f"the lease store cannot be reached: "
                                             f"{type(error).__name__}")


def unknown_binding(name: str) -> Refusal:
    """The reply for a binding name this gateway was not configured with."""
    return Refusal(404, "unknown_binding", f"no binding called {name[:64]!r} here")


def receipt(config: GatewayConfig, name: str, epoch: int, seq: int | None,
            hops: int) -> dict[str, object]:
    """The reply to served work: who served it, under which epoch, which row (``None``
    where the work writes no row, ``"work": "validate"``)."""
    return {"binding": name, "served_by": config.connector_id, "epoch": epoch, "seq": seq,
            "hops": hops}


def holder_json(holder: HolderView | None) -> dict[str, object] | None:
    """A holder for ``/status``: connector, epoch, state, expiry, metadata."""
    if holder is None:
        return None
    return {"connector_id": holder.connector_id, "epoch": holder.epoch,
            "state": str(holder.state), "expires_at": holder.expires_at.isoformat(),
            "metadata": dict(holder.metadata)}
