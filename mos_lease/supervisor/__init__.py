"""A supervisor for many bindings: one thread or one task campaigns for, holds and renews
the leases of every binding a gateway process runs.

``campaign`` holds the campaign rule (shared with :func:`~mos_lease.hold`), ``schedule``
the pure decisions for all bindings, made with the values of ``slots``
(the bindings, their state and the calls to make) and reporting those of ``changes``;
``flow`` the turn written once, ``fleet`` its part for a member of a fleet (``fleet=``),
``handover`` a planned hand-off of one binding, ``granting`` a grant for a binding;
``notices`` the one notice subscription (``notices=``);
``runner`` the two supervisors that perform it (the asyncio one, and the thread one generated
from it by ``tools/async_to_sync.py``), written over the thread and asyncio ``primitives``
and what they share in ``base``. ``docs/keeping.md`` explains the campaign, the batched
renewal and the changes reported.
"""

from mos_lease.supervisor.campaign import TakeoverPolicy
from mos_lease.supervisor.changes import (
    BindingLost,
    BindingStarted,
    Change,
    GaveUp,
    Moved,
    NewHolder,
)
from mos_lease.supervisor.handover import HandoverResult
from mos_lease.supervisor.notices import NoticeFeed
from mos_lease.supervisor.runner import AsyncSupervisor, Supervisor
from mos_lease.supervisor.schedule import BATCH, COALESCE
from mos_lease.supervisor.slots import Binding

__all__ = ["BATCH", "COALESCE", "AsyncSupervisor", "Binding", "BindingLost", "BindingStarted",
           "Change", "GaveUp", "HandoverResult", "Moved", "NewHolder", "NoticeFeed", "Supervisor",
           "TakeoverPolicy"]
