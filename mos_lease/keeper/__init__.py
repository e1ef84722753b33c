"""Lease keepers: heartbeat a lease in the background and know, locally, when it is gone.

``schedule`` holds the pure decisions (when to renew, retry, or count the lease lost),
``calls`` the coordinator calls a keeper makes and the loops that make them, ``steps`` the
keeper's steps written once, ``drivers`` the thread and asyncio keepers that run them. Why
the local deadline is safe is explained in ``docs/keeper.md``.
"""

from mos_lease.keeper import schedule
from mos_lease.keeper.drivers import AsyncLeaseKeeper, LeaseKeeper
from mos_lease.keeper.schedule import *  # noqa: F403  (the names schedule.__all__ lists)

__all__ = ["AsyncLeaseKeeper", "LeaseKeeper"]
__all__ += schedule.__all__
