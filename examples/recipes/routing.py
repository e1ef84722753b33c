"""Where a request for a binding goes: served here, forwarded to the holder, or refused.

A pure decision over what the gateway knows at that moment: whether its supervisor holds the
binding's lease, and the holder the store shows (``current_holder()``, whose metadata names
the holder's endpoint). The route is a hint like any read: the holder may change a moment
later, and fencing never depends on it. A request forwarded to a process that no longer
holds the binding is routed again there, up to the configured hop limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import attrs

from examples.recipes.config import GatewayConfig, RouteBinding, check_endpoint
from examples.recipes.screen import Refusal
from mos_lease import LeaseIdentity
from mos_lease.fleet import FleetStatus
from mos_lease.results import GrantResult, HolderView
from mos_lease.vocabulary import LeaseState

RETRY_AFTER = 1  # seconds: about the supervisor's backoff while it campaigns
READ_BATCH = 1_000  # identities per current_holders() call: the most one call reads


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
        # Our own connector id, but no lease here: a previous run of this process, whose
        # lease has yet to expire, or a takeover this supervisor has just committed and
        # not yet recorded (the read came between the two). Never forward to ourselves.
        return Refusal(503, "not_held_here",
                       "the store names this gateway as the holder but this process holds "
                       "no lease yet: a previous run's lease not yet expired, or a takeover "
                       "being recorded; try again")
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


def batches(bindings: Sequence[RouteBinding]) -> Iterator[list[LeaseIdentity]]:
    """The bindings' identities, :data:`READ_BATCH` at a time: ``/status`` reads thousands
    of holders in a few ``current_holders()`` calls, not one round trip each."""
    for start in range(0, len(bindings), READ_BATCH):
        yield [b.identity for b in bindings[start:start + READ_BATCH]]


def status_json(config: GatewayConfig, holders: Sequence[HolderView | None],
                held_here: Callable[[LeaseIdentity], bool],
                fleet: FleetStatus | None) -> dict[str, object]:
    """``/status``: each configured binding's holder (``holders``, in the configuration's
    order) and whether this process holds it, and, in a fleet, what this member sees of it:
    the live members and their endpoints, and its share."""
    bindings = [{"name": b.name, "held_here": held_here(b.identity),
                 "holder": holder_json(holder)}
                for b, holder in zip(config.bindings, holders, strict=True)]
    return {**fleet_json(config, fleet), "bindings": bindings}


def fleet_json(config: GatewayConfig, status: FleetStatus | None) -> dict[str, object]:
    """``/fleet`` (and the head of ``/status``): this process, and what it sees of its fleet
    (``null`` without one): the live members and their endpoints, the bindings it holds,
    those preferred to it, those of them not held yet, those it saw without a holder, and
    its hand-offs. No read of the store: the supervisor's last member read."""
    fleet: dict[str, object] | None = None
    if status is not None:
        members = [] if status.view is None else [
            {"name": m.name, "endpoint": m.endpoint} for m in status.view.members]
        fleet = {"members": members, "held": status.held, "preferred": status.preferred,
                 "preferred_not_held": status.preferred_not_held, "unheld": status.unheld,
                 "hand_offs": status.hand_offs}
    return {"connector_id": config.connector_id, "endpoint": config.endpoint, "fleet": fleet}
