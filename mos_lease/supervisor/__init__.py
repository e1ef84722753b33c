"""A supervisor for many bindings: one thread or one task campaigns for, holds and renews
the leases of every binding a gateway process runs.

``schedule`` holds the pure decisions for all bindings, ``flow`` the turn written once,
``drivers`` the thread and asyncio supervisors that perform it. ``docs/supervisor.md``
explains the campaign, the batched renewal and the changes reported.
"""

from mos_lease.supervisor.drivers import AsyncSupervisor, Supervisor
from mos_lease.supervisor.schedule import (
    BATCH,
    COALESCE,
    Binding,
    BindingLost,
    BindingStarted,
    Change,
    NewHolder,
)

__all__ = ["BATCH", "COALESCE", "AsyncSupervisor", "Binding", "BindingLost", "BindingStarted",
           "Change", "NewHolder", "Supervisor"]
