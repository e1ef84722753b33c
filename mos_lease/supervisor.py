"""The supervisor: one thread or one task campaigns for, holds and renews the leases of
every binding a gateway process runs. :class:`Supervisor` and :class:`AsyncSupervisor` are
the public face of the keep engine (``mos_lease/keep/``), which :func:`~mos_lease.hold`
and the keepers run on as well; ``docs/keeping.md`` explains the campaign, the batched
renewal and the changes reported.
"""

from mos_lease.keep.campaign import TakeoverPolicy
from mos_lease.keep.changes import (
    BindingLost,
    BindingStarted,
    Change,
    GaveUp,
    Moved,
    NewHolder,
)
from mos_lease.keep.handover import HandoverResult
from mos_lease.keep.notices import NoticeFeed
from mos_lease.keep.runner import AsyncSupervisor, Supervisor
from mos_lease.keep.schedule import BATCH, COALESCE
from mos_lease.keep.slots import Binding

__all__ = ["BATCH", "COALESCE", "AsyncSupervisor", "Binding", "BindingLost", "BindingStarted",
           "Change", "GaveUp", "HandoverResult", "Moved", "NewHolder", "NoticeFeed", "Supervisor",
           "TakeoverPolicy"]
