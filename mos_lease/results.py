"""Typed results. A denial is a value with a stable reason, never an exception."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Generic, TypeVar

import attrs

from mos_lease.context import ConnectorExecutionContext
from mos_lease.grants import ExecutionGrant
from mos_lease.metadata import EMPTY_METADATA, Metadata
from mos_lease.records import LeaseHandle, LeaseRow
from mos_lease.vocabulary import LeaseState, Outcome, Reason

T = TypeVar("T")


@attrs.frozen(slots=True)
class LeaseResult:
    """Outcome of acquire, takeover, heartbeat or release.

    On success ``lease`` is the handle to keep. On a state-based denial ``current_epoch`` is
    the epoch of the current row (what a takeover must name as its expected epoch), or
    ``None`` if no row exists or the policy refused before the lease was looked at.
    ``reconciled`` is true when the write's commit outcome was lost and established by
    rereading the store. ``holder`` is the lease as a state-based denial found it (``None``
    when ``current_epoch`` is): pass it as ``observed=`` to a takeover at that epoch, which
    then needs no read of its own.
    """

    outcome: Outcome
    reason: Reason | None
    correlation_id: str
    lease: LeaseHandle | None = None
    current_epoch: int | None = None
    reconciled: bool = False
    holder: HolderView | None = None

    @property
    def ok(self) -> bool:
        """Whether the operation succeeded (``reason`` is ``None``)."""
        return self.reason is None


@attrs.frozen(slots=True)
class GrantResult:
    """Outcome of :meth:`~mos_lease.ConnectorLeaseCoordinator.issue_grant`: ``grant`` is the
    new :class:`ExecutionGrant` exactly when ``reason`` is ``None``."""

    outcome: Outcome
    reason: Reason | None
    correlation_id: str
    grant: ExecutionGrant | None = None

    @property
    def ok(self) -> bool:
        """Whether a grant was minted (``reason`` is ``None``)."""
        return self.reason is None


@attrs.frozen(slots=True)
class ValidationResult:
    """``context`` is set exactly when the grant is valid for the requested scopes."""

    reason: Reason | None
    context: ConnectorExecutionContext | None = None

    @property
    def ok(self) -> bool:
        """Whether the grant is valid (``reason`` is ``None``)."""
        return self.reason is None


@attrs.frozen(slots=True)
class RenewalResult:
    """Outcome of :meth:`~mos_lease.ConnectorLeaseCoordinator.renew_grant`: on success
    ``grant`` is the successor grant (renew it next) and ``context`` the fresh context for
    the running tool, both with the new expiry; on a refusal both are ``None`` and
    ``reason`` is the one validation would give the old grant (or the policy's)."""

    reason: Reason | None
    correlation_id: str
    grant: ExecutionGrant | None = None
    context: ConnectorExecutionContext | None = None

    @property
    def ok(self) -> bool:
        """Whether the grant was renewed (``reason`` is ``None``)."""
        return self.reason is None


@attrs.frozen(slots=True)
class InvocationResult(Generic[T]):
    """Outcome of :meth:`~mos_lease.ConnectorLeaseCoordinator.invoke`: the adapter ran and
    returned ``value`` only if validation passed."""

    reason: Reason | None
    context: ConnectorExecutionContext | None = None
    value: T | None = None

    @property
    def ok(self) -> bool:
        """Whether validation passed and the adapter ran (``reason`` is ``None``)."""
        return self.reason is None


@attrs.frozen(slots=True)
class HolderView:
    """Who holds an identity's lease, as :meth:`~mos_lease.ConnectorLeaseCoordinator.
    current_holder` read it: for dashboards and waiters.

    Deliberately without the lease UUID and the scopes: a view can be shown or logged
    anywhere, and what is not here cannot be used to heartbeat, release or mint grants.
    ``state`` is judged at ``now``, the store's time of the same read; ``expires_at`` is
    the store's expiry of the row (for a released row, the expiry it had when released).
    ``metadata`` is what the holder set when it acquired or took over (an empty mapping if
    it set none), read-only: where a gateway routes requests for this binding, for example.
    ``metadata_invalid`` is true when the stored metadata breaks the rules every write
    passes (a row written around the library): it is withheld, ``metadata`` is empty, and
    nothing else about the view or the lease is affected.
    """

    connector_id: str
    epoch: int
    state: LeaseState
    expires_at: datetime
    now: datetime
    # Kept as a Metadata even when a view is built by hand: a view is never changed in place.
    metadata: Mapping[str, str] = attrs.field(default=EMPTY_METADATA, converter=Metadata)
    metadata_invalid: bool = False

    @classmethod
    def of(cls, row: LeaseRow, now: datetime) -> HolderView:
        """What may be shown of ``row`` read at store time ``now``."""
        return cls(connector_id=row.connector_id, epoch=row.epoch, state=row.state(now),
                   expires_at=row.expires_at, now=now, metadata=row.metadata,
                   metadata_invalid=row.metadata_invalid)
