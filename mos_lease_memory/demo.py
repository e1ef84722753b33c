"""A scripted failover on the in-memory store, narrated step by step (``mos-lease demo``)."""

from __future__ import annotations

from collections.abc import Callable

from mos_lease.clock import ManualClock
from mos_lease.context import ConnectorExecutionContext
from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.identity import LeaseIdentity
from mos_lease.policy import StaticConnectorPolicy
from mos_lease.results import GrantResult, InvocationResult, LeaseResult, ValidationResult
from mos_lease_memory.store import InMemoryLeaseStore

POLICY = {"rules": [
    {"tenant_id": "acme", "logical_agent_id": "*", "binding_id": "*", "connector_id": name,
     "scopes": ["repo:read", "tool:shell"], "max_lease_ttl": 60, "max_grant_ttl": 10,
     "preempt_active": False}
    for name in ("claude-a", "codex-b")
]}


Result = LeaseResult | GrantResult | ValidationResult | InvocationResult[str]


def _describe(result: Result) -> str:
    if result.ok:
        if isinstance(result, LeaseResult) and result.lease is not None:
            return f"{result.outcome} at epoch {result.lease.epoch}"
        if isinstance(result, GrantResult) and result.grant is not None:
            return f"{result.outcome} (epoch {result.grant.epoch}, scopes {result.grant.scopes})"
        if isinstance(result, InvocationResult):
            return f"valid; adapter {result.value}"
        return "valid"
    return f"REFUSED: {result.reason}"


def run(out: Callable[[str], object] = print) -> int:
    clock = ManualClock()
    store = InMemoryLeaseStore(clock)
    gateway = ConnectorLeaseCoordinator(store, StaticConnectorPolicy.from_dict(POLICY))
    agent = LeaseIdentity("acme", "agent-7", "slack-main")

    def step(text: str, result: Result) -> None:
        out(f"t+{(clock.now() - start).total_seconds():>4.0f}s  {text:<52} {_describe(result)}")

    def adapter(context: ConnectorExecutionContext) -> str:
        return f"ran with epoch {context.epoch}"

    start = clock.now()
    out(f"Logical agent {agent}; connectors claude-a and codex-b; lease TTL 30 s.\n")
    a = gateway.acquire(agent, "claude-a", scopes=["repo:read", "tool:shell"], ttl=30)
    step("claude-a acquires the lease", a)
    assert a.lease is not None
    grant = gateway.issue_grant(a.lease, scopes=["tool:shell"], ttl=10)
    step("claude-a gets a 10 s grant for tool:shell", grant)
    assert grant.grant is not None
    invoked = gateway.invoke(grant.grant, adapter, identity=agent, scopes=["tool:shell"])
    step("gateway validates the grant and invokes the adapter", invoked)

    out("\nclaude-a stalls; nobody heartbeats for 31 s ...\n")
    clock.advance(31)
    b = gateway.acquire(agent, "codex-b", scopes=["repo:read"], ttl=30)
    step("codex-b tries a plain acquire", b)
    assert b.current_epoch is not None
    b = gateway.takeover(agent, "codex-b", scopes=["repo:read"], ttl=30,
                         expected_epoch=b.current_epoch)
    step(f"codex-b takes over (expected epoch {b.current_epoch and b.current_epoch - 1})", b)

    out("\nclaude-a wakes up and carries on as if nothing happened:\n")
    step("claude-a heartbeats its old lease", gateway.heartbeat(a.lease, ttl=30))
    step("claude-a asks for a fresh grant", gateway.issue_grant(a.lease, scopes=["tool:shell"],
                                                                ttl=5))
    step("claude-a's old grant is validated",
         gateway.validate(grant.grant, identity=agent, scopes=["tool:shell"]))
    step("claude-a tries to release", gateway.release(a.lease))

    out("\nAudit trail (no scopes, grants, payloads or credentials are ever recorded):\n")
    out(f"{'seq':>3}  {'event':<15}{'outcome':<13}{'reason':<18}{'connector':<14}epoch")
    for record in store.audit(agent):
        e = record.entry
        out(f"{record.seq:>3}  {e.event:<15}{e.outcome:<13}{e.reason or '-':<18}"
            f"{e.connector_id:<14}{e.epoch if e.epoch is not None else '-'}")
    return 0
