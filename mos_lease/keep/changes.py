"""The changes a supervisor reports for a binding (:data:`Change`): it started holding a
lease, lost it, saw another holder while campaigning, gave up waiting, or handed it over
(to another member of its fleet, or to a named connector). What a gateway reads from
``on_change`` or ``changes()``, apart from the schedule that finds them.
"""

from __future__ import annotations

import attrs

from mos_lease.identity import LeaseIdentity
from mos_lease.keep.timing import LeaseLoss
from mos_lease.records import LeaseHandle
from mos_lease.results import HolderView
from mos_lease.vocabulary import Reason


@attrs.frozen(slots=True)
class BindingStarted:
    """The binding now holds ``lease`` (acquired or taken over)."""

    identity: LeaseIdentity
    lease: LeaseHandle


@attrs.frozen(slots=True)
class BindingLost:
    """The binding lost ``lease``; ``loss`` says why and when, as a keeper reports it. The
    supervisor campaigns again unless the binding was removed (cause ``STOPPED``)."""

    identity: LeaseIdentity
    lease: LeaseHandle
    loss: LeaseLoss


@attrs.frozen(slots=True)
class NewHolder:
    """Another holder (or another epoch of the lease) was observed while campaigning."""

    identity: LeaseIdentity
    holder: HolderView


@attrs.frozen(slots=True)
class GaveUp:
    """The binding's wait ran out (``add(..., wait=...)``), or a refusal that waiting cannot
    change ended it at once (the policy's, an exhausted epoch); the supervisor no longer runs
    it. ``reason`` is the last reason the lease could not be had, ``holder`` the last view
    of who holds it (``None`` if none was seen), ``error`` the last store error, if any:
    what :class:`~mos_lease.holder.LeaseNotAcquired` carries."""

    identity: LeaseIdentity
    reason: Reason
    holder: HolderView | None
    error: str | None = None


@attrs.frozen(slots=True)
class Moved:
    """The binding's ``lease`` was handed over to ``successor`` and released naming it: a
    planned move, not a loss to a rival. The successor is another member of this
    supervisor's fleet that the placement now prefers for it (``Supervisor(fleet=...)``), or
    the connector named by ``handover(identity, to=...)``. It takes the lease over at its
    epoch; this supervisor goes on running the binding and takes it again if the placement
    brings it back, or if it stays without a holder past the grace period."""

    identity: LeaseIdentity
    lease: LeaseHandle
    successor: str


Change = BindingStarted | BindingLost | NewHolder | GaveUp | Moved
