"""Lease keepers: heartbeat a lease in the background and know, locally, when it is gone.

``schedule`` holds the pure decisions (when to renew, retry, or count the lease lost),
used by the supervisor engine (:mod:`mos_lease.supervisor`) for every lease it keeps;
``calls`` the coordinator calls a keeper makes and the loops that make them;
``base`` what the two keepers share, and ``thread_keeper`` and ``asyncio_keeper`` the two
keepers: each the engine with one binding, held once. Why the local deadline is safe is
explained in ``docs/keeping.md``.
"""

from mos_lease.keeper import schedule
from mos_lease.keeper.asyncio_keeper import AsyncLeaseKeeper
from mos_lease.keeper.schedule import *  # noqa: F403  (the names schedule.__all__ lists)
from mos_lease.keeper.thread_keeper import LeaseKeeper

__all__ = ["AsyncLeaseKeeper", "LeaseKeeper"]
__all__ += schedule.__all__
