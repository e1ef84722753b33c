"""mos-lease: durable logical-agent identity and fenced connector leases.

The top level holds what a gateway author uses: the coordinators, ``hold()`` and the keepers,
identities, policies, results, fencing tokens and the exceptions. The rest is imported from
the submodule named for what it holds: a store's contract and records from
:mod:`mos_lease.ports` and :mod:`mos_lease.records`, telemetry events from
:mod:`mos_lease.events`, the TTL caps from :mod:`mos_lease.identity`, resource guards'
decisions from :mod:`mos_lease.fencing` and so on (``docs/reference/mos_lease.md``).
``__version__`` is the installed distribution's version (:mod:`mos_lease.version`).
"""

from typing import TYPE_CHECKING

from mos_lease.context import ConnectorExecutionContext
from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator
from mos_lease.errors import (
    CommitOutcomeUnknown,
    ConfigurationError,
    InvalidInput,
    MosLeaseError,
    StoreUnavailable,
)
from mos_lease.fencing import FencedEffectRefused, ResourceGuard
from mos_lease.grants import ExecutionGrant
from mos_lease.holder import (
    AsyncHolder,
    HoldCallbacks,
    Holder,
    HoldTiming,
    LeaseLost,
    LeaseNotAcquired,
    TakeoverPolicy,
    hold,
)
from mos_lease.identity import LeaseIdentity
from mos_lease.keeper import AsyncLeaseKeeper, LeaseKeeper, LeaseLoss, LossCause
from mos_lease.machine import PolicyVerdict
from mos_lease.policy import (
    AllowAllPolicy,
    ConnectorLeaseService,
    DenyAllPolicy,
    PolicyRequest,
    StaticConnectorPolicy,
)
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, InvocationResult, LeaseResult, ValidationResult
from mos_lease.supervisor import AsyncSupervisor, Supervisor
from mos_lease.token import FencingToken
from mos_lease.vocabulary import Outcome, Reason

__all__ = [
    "AllowAllPolicy",
    "AsyncConnectorLeaseCoordinator",
    "AsyncHolder",
    "AsyncLeaseKeeper",
    "AsyncSupervisor",
    "CommitOutcomeUnknown",
    "ConfigurationError",
    "ConnectorExecutionContext",
    "ConnectorLeaseCoordinator",
    "ConnectorLeaseService",
    "DenyAllPolicy",
    "ExecutionGrant",
    "FencedEffectRefused",
    "FencingToken",
    "GrantResult",
    "HoldCallbacks",
    "HoldTiming",
    "Holder",
    "InvalidInput",
    "InvocationResult",
    "LeaseHandle",
    "LeaseIdentity",
    "LeaseKeeper",
    "LeaseLoss",
    "LeaseLost",
    "LeaseNotAcquired",
    "LeaseResult",
    "LossCause",
    "MosLeaseError",
    "Outcome",
    "PolicyRequest",
    "PolicyVerdict",
    "Reason",
    "ResourceGuard",
    "StaticConnectorPolicy",
    "StoreUnavailable",
    "Supervisor",
    "TakeoverPolicy",
    "ValidationResult",
    "hold",
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
