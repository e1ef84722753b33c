"""The options and the process-local state every flow of one coordinator shares."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Final
from uuid import UUID

from mos_lease.checks import CheckedInputs, check_cap, check_collaborators, check_retries
from mos_lease.clock import MonotonicClock
from mos_lease.errors import ConfigurationError
from mos_lease.grants import GrantRegistry
from mos_lease.identity import GRANT_TTL_CAP, LEASE_TTL_CAP, check_correlation_id
from mos_lease.machine import PolicyVerdict
from mos_lease.policy import ConnectorLeaseService, DenyAllPolicy, PolicyRequest
from mos_lease.ports import IdSource
from mos_lease.views import ViewRegistry

log = logging.getLogger("mos_lease")

DEFAULT_MAX_CONFLICT_RETRIES: Final = 8


class FlowOptions:
    """What every flow of one coordinator shares: its checked options, its policy and id
    source, and the process-local registries (grants minted, holder views shown)."""

    def __init__(
        self,
        policy: ConnectorLeaseService | None,
        *,
        lease_ttl_cap: timedelta | float = LEASE_TTL_CAP,
        grant_ttl_cap: timedelta | float = GRANT_TTL_CAP,
        id_source: IdSource,
        max_conflict_retries: int = DEFAULT_MAX_CONFLICT_RETRIES,
        monotonic_clock: MonotonicClock,
    ) -> None:
        check_collaborators(policy, id_source, monotonic_clock)
        self.policy: ConnectorLeaseService = DenyAllPolicy() if policy is None else policy
        self.lease_ttl_cap = check_cap("lease_ttl_cap", lease_ttl_cap, LEASE_TTL_CAP)
        self.grant_ttl_cap = check_cap("grant_ttl_cap", grant_ttl_cap, GRANT_TTL_CAP)
        self.max_conflict_retries = check_retries(max_conflict_retries)
        if policy is None:  # once the arguments are known to be good
            # Deny-all is the safe default, but on its own it looks like a broken gateway.
            log.warning("coordinator built without a policy: the default DenyAllPolicy "
                        "refuses every lease and grant operation; pass policy= (e.g. "
                        "StaticConnectorPolicy.from_dict(...)) to allow any")
        self.ids: Callable[[], UUID] = id_source
        self.monotonic = monotonic_clock
        self.grants = GrantRegistry()
        self.views = ViewRegistry()
        self.inputs = CheckedInputs()

    def correlation(self, correlation_id: object) -> str:
        # Without one from the caller, a fresh id of its own: a correlation id names the
        # caller's operation, which may span several audit events (retries, a batch), so it
        # is never one of their event ids.
        given = check_correlation_id("correlation_id", correlation_id)
        return given if given is not None else self.ids().hex

    def verdict(self, request: PolicyRequest) -> PolicyVerdict:
        verdict = self.policy.authorize(request)
        if not isinstance(verdict, PolicyVerdict):
            raise ConfigurationError(
                f"policy returned {type(verdict).__name__}, expected PolicyVerdict")
        return verdict
