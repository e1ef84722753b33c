"""What an adapter receives: the only view of the lease that crosses into adapter code."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

import attrs

from mos_lease.identity import LeaseIdentity


@attrs.frozen(slots=True)
class ConnectorExecutionContext:
    """The normalized lease context of one validated invocation.

    Adapters must carry ``epoch`` (or the whole context, see :mod:`mos_lease.token`) to every
    downstream effect boundary, so that a race after gateway validation can still be fenced
    there. ``scopes`` are the effective scopes: those requested, all of which are authorized
    by both the grant and the current lease. ``expires_at`` is the earlier of the grant's and
    the lease's expiry, in store time.
    """

    identity: LeaseIdentity
    connector_id: str
    lease_id: UUID
    epoch: int
    scopes: tuple[str, ...]
    expires_at: datetime
    correlation_id: str
