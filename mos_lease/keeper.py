"""Lease keepers: heartbeat a lease you already hold in the background and know, locally, when
it is gone. Each keeper is the keep engine (:mod:`mos_lease.supervisor`'s) with one binding, held
once; the deadline rules it and every supervised lease are kept by are
:mod:`mos_lease.keep.timing`'s. Why the local deadline is safe is explained in
``docs/keeping.md``.
"""

from mos_lease.keep import timing
from mos_lease.keep.asyncio_keeper import AsyncLeaseKeeper
from mos_lease.keep.thread_keeper import LeaseKeeper
from mos_lease.keep.timing import *  # noqa: F403  (the names timing.__all__ lists)

__all__ = ["AsyncLeaseKeeper", "LeaseKeeper"]
__all__ += timing.__all__
