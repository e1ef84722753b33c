"""mos-lease: durable logical-agent identity and fenced connector leases.

The public names live here; submodules are named for what they hold. ``__version__`` is the
installed distribution's version (:mod:`mos_lease.version`).
"""

from typing import TYPE_CHECKING

from mos_lease.adapter import (
    AsyncConnectorAdapter,
    ConnectorAdapter,
    run_adapter,
    run_adapter_async,
)
from mos_lease.context import ConnectorExecutionContext
from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator
from mos_lease.errors import (
    CommitOutcomeUnknown,
    ConfigurationError,
    GrantNotTransferable,
    InternalInconsistency,
    InvalidInput,
    MosLeaseError,
    StoreUnavailable,
)
from mos_lease.events import (
    Event,
    EventHook,
    Lost,
    OperationFinished,
    RenewalRetry,
    Renewed,
    StoreCall,
)
from mos_lease.fencing import (
    AsyncResourceGuard,
    FencedEffectRefused,
    FenceReason,
    GuardDecision,
    ResourceEpoch,
    ResourceGuard,
)
from mos_lease.grants import ExecutionGrant
from mos_lease.holder import (
    AsyncHolder,
    Holder,
    LeaseLost,
    LeaseNotAcquired,
    TakeoverPolicy,
    hold,
)
from mos_lease.identity import (
    GRANT_TTL_CAP,
    LEASE_TTL_CAP,
    MAX_EPOCH,
    SCOPE_GRAMMAR,
    LeaseIdentity,
)
from mos_lease.keeper import AsyncLeaseKeeper, LeaseKeeper, LeaseLoss, LossCause
from mos_lease.machine import PolicyVerdict
from mos_lease.notice_confirmer import NoticeConfirmer, shared_confirmer
from mos_lease.notice_gate import NoticeStats
from mos_lease.policy import (
    AllowAllPolicy,
    ConnectorLeaseService,
    ConnectorRule,
    DenyAllPolicy,
    PolicyRequest,
    StaticConnectorPolicy,
)
from mos_lease.ports import AsyncLeaseStore, LeaseInspector, LeaseStore
from mos_lease.records import AuditEntry, AuditRecord, LeaseHandle, LeaseRow, Snapshot
from mos_lease.results import (
    GrantResult,
    HolderView,
    InvocationResult,
    LeaseResult,
    ValidationResult,
)
from mos_lease.token import FencingToken, format_token, parse_token
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome, Reason

__all__ = [
    "GRANT_TTL_CAP",
    "LEASE_TTL_CAP",
    "MAX_EPOCH",
    "SCOPE_GRAMMAR",
    "AllowAllPolicy",
    "AsyncConnectorAdapter",
    "AsyncConnectorLeaseCoordinator",
    "AsyncHolder",
    "AsyncLeaseKeeper",
    "AsyncLeaseStore",
    "AsyncResourceGuard",
    "AuditEntry",
    "AuditRecord",
    "CommitOutcomeUnknown",
    "ConfigurationError",
    "ConnectorAdapter",
    "ConnectorExecutionContext",
    "ConnectorLeaseCoordinator",
    "ConnectorLeaseService",
    "ConnectorRule",
    "DenyAllPolicy",
    "Event",
    "EventHook",
    "ExecutionGrant",
    "FenceReason",
    "FencedEffectRefused",
    "FencingToken",
    "GrantNotTransferable",
    "GrantResult",
    "GuardDecision",
    "Holder",
    "HolderView",
    "InternalInconsistency",
    "InvalidInput",
    "InvocationResult",
    "LeaseHandle",
    "LeaseIdentity",
    "LeaseInspector",
    "LeaseKeeper",
    "LeaseLoss",
    "LeaseLost",
    "LeaseNotAcquired",
    "LeaseResult",
    "LeaseRow",
    "LeaseState",
    "LeaseStore",
    "LifecycleEvent",
    "LossCause",
    "Lost",
    "MosLeaseError",
    "NoticeConfirmer",
    "NoticeStats",
    "OperationFinished",
    "Outcome",
    "PolicyRequest",
    "PolicyVerdict",
    "Reason",
    "RenewalRetry",
    "Renewed",
    "ResourceEpoch",
    "ResourceGuard",
    "Snapshot",
    "StaticConnectorPolicy",
    "StoreCall",
    "StoreUnavailable",
    "TakeoverPolicy",
    "ValidationResult",
    "format_token",
    "hold",
    "parse_token",
    "run_adapter",
    "run_adapter_async",
    "shared_confirmer",
]


if TYPE_CHECKING:
    __version__: str
else:
    # Hidden from type checkers, which would otherwise accept any attribute of the package.
    def __getattr__(name: str) -> str:
        # __version__ is read from the installed metadata on first use: importing
        # importlib.metadata costs tens of milliseconds that importing the package need not.
        if name == "__version__":
            from mos_lease.version import installed_version

            return installed_version()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
