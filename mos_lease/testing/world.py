"""The world the stateful specification (:mod:`mos_lease.testing.stateful`) runs in: the
scopes, TTLs, time steps and connectors it draws from, their policy, and what the machine
remembers of a minted grant."""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from mos_lease.grants import ExecutionGrant
from mos_lease.policy import StaticConnectorPolicy
from mos_lease.testing.oracle import ModelRule

SCOPES = ("a", "b", "c")
LEASE_TTLS = (10.5, 30.5, 90.5)  # half seconds: never exactly on a whole-second step,
GRANT_TTLS = (5.5, 25.5)  # so a slowly drifting database clock cannot flip a boundary
STEPS = (1, 4, 9, 20, 35, 70)
CONNECTORS = ("c1", "c2", "c3", "rogue")
RULES = {
    "c1": ModelRule(frozenset({"a", "b"}), 60, 20, preempt_active=False),
    "c2": ModelRule(frozenset({"a", "b"}), 60, 20, preempt_active=False),
    "c3": ModelRule(frozenset(SCOPES), 300, 30, preempt_active=True),
}
POLICY = StaticConnectorPolicy.from_dict({"rules": [
    {"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*", "connector_id": name,
     "scopes": sorted(r.scopes), "max_lease_ttl": r.max_lease_ttl,
     "max_grant_ttl": r.max_grant_ttl, "preempt_active": r.preempt_active}
    for name, r in RULES.items()
]})

scope_sets = st.frozensets(st.sampled_from(SCOPES), max_size=3)


@attrs.frozen
class Minted:
    grant: ExecutionGrant
    gateway: int
    generation: int
    expires: float  # model time


__all__ = ["CONNECTORS", "GRANT_TTLS", "LEASE_TTLS", "POLICY", "RULES", "SCOPES", "STEPS",
           "Minted", "scope_sets"]
