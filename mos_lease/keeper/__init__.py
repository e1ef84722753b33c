"""Lease keepers: heartbeat a lease in the background and know, locally, when it is gone.

``schedule`` holds the pure decisions (when to renew, retry, or count the lease lost),
``calls`` the coordinator calls a keeper makes and the loops that make them, ``steps`` the
keeper's steps written once, ``base`` what the two keepers share, and ``thread_keeper`` and
``asyncio_keeper`` the drivers that run the steps. Why the local deadline is safe is
explained in ``docs/keeper.md``.
"""

from mos_lease.keeper import schedule
from mos_lease.keeper.asyncio_keeper import AsyncLeaseKeeper
from mos_lease.keeper.schedule import *  # noqa: F403  (the names schedule.__all__ lists)
from mos_lease.keeper.thread_keeper import LeaseKeeper

__all__ = ["AsyncLeaseKeeper", "LeaseKeeper"]
__all__ += schedule.__all__
