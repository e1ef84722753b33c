"""Lease keepers: heartbeat a lease in the background and know, locally, when it is gone.

``schedule`` holds the pure decisions (when to renew, retry, or count the lease lost),
``flow`` the steps written once, ``drivers`` the thread and asyncio keepers that run them.
Why the local deadline is safe is explained in ``docs/keeper.md``.
"""

from mos_lease.keeper.drivers import AsyncLeaseKeeper, LeaseKeeper
from mos_lease.keeper.schedule import (
    DEFAULT_CLOCK_STEP,
    LEASE_GONE_REASONS,
    TRANSIENT_ERRORS,
    Action,
    HeartbeatDue,
    KeeperState,
    KeeperTiming,
    LeaseLoss,
    LossCause,
    Lost,
    Wait,
    after_renewal,
    grant_loss,
    held,
    local_refusal,
    lose,
    next_action,
)

__all__ = [
    "DEFAULT_CLOCK_STEP",
    "LEASE_GONE_REASONS",
    "TRANSIENT_ERRORS",
    "Action",
    "AsyncLeaseKeeper",
    "HeartbeatDue",
    "KeeperState",
    "KeeperTiming",
    "LeaseKeeper",
    "LeaseLoss",
    "LossCause",
    "Lost",
    "Wait",
    "after_renewal",
    "grant_loss",
    "held",
    "local_refusal",
    "lose",
    "next_action",
]
