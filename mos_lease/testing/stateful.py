"""The executable specification: a Hypothesis state machine any store can be plugged into.

Several connectors and two gateways (each a coordinator instance with its own grants) share
one store and a controllable clock. Every step is predicted by the independent
:class:`~mos_lease.testing.oracle.Oracle`; after every step the machine checks that the store
agrees with the model, that epochs only rise, that no grant of an older epoch is still usable
and that the step appended exactly the audit row the model expects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.identity import LeaseIdentity
from mos_lease.machine import grant_refusal
from mos_lease.records import AuditRecord, LeaseHandle
from mos_lease.testing.harness import StoreHarness
from mos_lease.testing.oracle import Expected, ModelLease, Oracle
from mos_lease.testing.waves import Waves
from mos_lease.testing.world import (
    CONNECTORS,
    GRANT_TTLS,
    LEASE_TTLS,
    POLICY,
    RULES,
    STEPS,
    Minted,
    scope_sets,
)


def make_lease_machine(harness_factory: Callable[[], StoreHarness]) -> type[RuleBasedStateMachine]:
    """A state machine class running the whole protocol against stores from the factory.

    Use it in a test module as ``TestMyStore = make_lease_machine(factory).TestCase``.
    """

    class LeaseMachine(Waves, RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.harness = harness_factory()
            run = uuid4().hex[:12]
            # Fresh tenants per run: stores never delete, so runs are isolated by identity.
            self.tenant, self.other_tenant = f"t-{run}", f"u-{run}"
            self.identities = [LeaseIdentity(self.tenant, "agent-a", "bind-1"),
                               LeaseIdentity(self.tenant, "agent-a", "bind-2"),
                               LeaseIdentity(self.tenant, "agent-b", "bind-1")]
            self.foreign = LeaseIdentity(self.other_tenant, "agent-a", "bind-1")
            self.oracle = Oracle(RULES)
            self.gateways = [self._gateway(), self._gateway()]
            self.generations = [0, 0]
            self.handles: list[LeaseHandle] = []
            self.minted: list[Minted] = []
            self.highest_epoch: dict[LeaseIdentity, int] = {}
            self.audit_seen = 0

        def _gateway(self) -> ConnectorLeaseCoordinator:
            return ConnectorLeaseCoordinator(self.harness.store, POLICY)

        # -- bookkeeping ------------------------------------------------------------------

        def _audit_rows(self, after: int) -> Sequence[AuditRecord]:
            # Per identity, so a store shared with other runs is never scanned whole.
            rows = [r for identity in (*self.identities, self.foreign)
                    for r in self.harness.store.audit(identity, after_seq=after, limit=10_000)]
            return sorted(rows, key=lambda r: r.seq)

        def _check_audit(self, expected: Expected, identity: LeaseIdentity, connector: str,
                         correlation_id: str | None) -> None:
            new = self._audit_rows(self.audit_seen)
            if new:
                self.audit_seen = max(r.seq for r in new)
            if not expected.audited:
                assert not new, f"unexpected audit rows {new}"
                return
            assert len(new) == 1, f"expected one audit row for {expected}, got {new}"
            entry = new[0].entry
            got = (entry.event, entry.outcome, entry.reason, entry.identity,
                   entry.connector_id, entry.epoch)
            want = (expected.event, expected.outcome, expected.reason, identity, connector,
                    expected.audit_epoch)
            assert got == want, f"audit {got} != model {want}"
            if correlation_id is not None:
                assert entry.correlation_id == correlation_id

        def _pick(self, data: st.DataObject, items: Sequence[Any]) -> Any:
            return items[data.draw(st.integers(0, len(items) - 1))]

        # -- rules --------------------------------------------------------------------------

        @rule(data=st.data(), connector=st.sampled_from(CONNECTORS), scopes=scope_sets,
              ttl=st.sampled_from(LEASE_TTLS))
        def acquire(self, data: st.DataObject, connector: str, scopes: frozenset[str],
                    ttl: float) -> None:
            identity = self._pick(data, self.identities)
            gateway = self._pick(data, self.gateways)
            expected = self.oracle.acquire(identity, connector, scopes, ttl)
            result = gateway.acquire(identity, connector, scopes=scopes, ttl=ttl)
            assert (result.outcome, result.reason) == (expected.outcome, expected.reason)
            if result.lease is not None:
                assert result.lease.epoch == 1
                self.oracle.leases[identity] = ModelLease(
                    1, result.lease.lease_id, connector, scopes, self.oracle.now + ttl)
                self.handles.append(result.lease)
            self._check_audit(expected, identity, connector, result.correlation_id)

        @rule(data=st.data(), connector=st.sampled_from(CONNECTORS), scopes=scope_sets,
              ttl=st.sampled_from(LEASE_TTLS), epoch_delta=st.sampled_from((0, 0, 0, -1, 1)))
        def takeover(self, data: st.DataObject, connector: str, scopes: frozenset[str],
                     ttl: float, epoch_delta: int) -> None:
            identity = self._pick(data, self.identities)
            gateway = self._pick(data, self.gateways)
            current = self.oracle.leases.get(identity)
            expected_epoch = max(1, (current.epoch if current else 1) + epoch_delta)
            expected = self.oracle.takeover(identity, connector, scopes, ttl, expected_epoch)
            result = gateway.takeover(identity, connector, scopes=scopes, ttl=ttl,
                                      expected_epoch=expected_epoch)
            assert (result.outcome, result.reason) == (expected.outcome, expected.reason)
            if result.lease is not None:
                assert current is not None and result.lease.epoch == current.epoch + 1
                assert result.lease.lease_id != current.lease_id
                self.oracle.leases[identity] = ModelLease(
                    result.lease.epoch, result.lease.lease_id, connector, scopes,
                    self.oracle.now + ttl)
                self.handles.append(result.lease)
            self._check_audit(expected, identity, connector, result.correlation_id)

        @precondition(lambda self: bool(self.handles))
        @rule(data=st.data(), ttl=st.sampled_from(LEASE_TTLS))
        def heartbeat(self, data: st.DataObject, ttl: float) -> None:
            handle: LeaseHandle = self._pick(data, self.handles)
            gateway = self._pick(data, self.gateways)
            expected = self.oracle.heartbeat(handle.identity, handle.connector_id,
                                             handle.lease_id, handle.epoch,
                                             frozenset(handle.scopes), ttl)
            result = gateway.heartbeat(handle, ttl=ttl)
            assert (result.outcome, result.reason) == (expected.outcome, expected.reason)
            if result.ok:
                self.oracle.leases[handle.identity].expires = self.oracle.now + ttl
            self._check_audit(expected, handle.identity, handle.connector_id,
                              result.correlation_id)

        @precondition(lambda self: bool(self.handles))
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            handle: LeaseHandle = self._pick(data, self.handles)
            gateway = self._pick(data, self.gateways)
            expected = self.oracle.release(handle.identity, handle.connector_id,
                                           handle.lease_id, handle.epoch,
                                           frozenset(handle.scopes))
            result = gateway.release(handle)
            assert (result.outcome, result.reason) == (expected.outcome, expected.reason)
            if result.ok:
                self.oracle.leases[handle.identity].released = True
            self._check_audit(expected, handle.identity, handle.connector_id,
                              result.correlation_id)

        @precondition(lambda self: bool(self.handles))
        @rule(data=st.data(), scopes=scope_sets, ttl=st.sampled_from(GRANT_TTLS))
        def issue_grant(self, data: st.DataObject, scopes: frozenset[str], ttl: float) -> None:
            handle: LeaseHandle = self._pick(data, self.handles)
            index = data.draw(st.integers(0, len(self.gateways) - 1))
            expected = self.oracle.issue_grant(handle.identity, handle.connector_id,
                                               handle.lease_id, handle.epoch, scopes, ttl)
            result = self.gateways[index].issue_grant(handle, scopes=scopes, ttl=ttl)
            assert (result.outcome, result.reason) == (expected.outcome, expected.reason)
            if result.grant is not None:
                lease = self.oracle.leases[handle.identity]
                self.minted.append(Minted(result.grant, index, self.generations[index],
                                           min(self.oracle.now + ttl, lease.expires)))
            self._check_audit(expected, handle.identity, handle.connector_id,
                              result.correlation_id)

        @precondition(lambda self: bool(self.minted))
        @rule(data=st.data(), requested=scope_sets, target_kind=st.sampled_from(
            ("same", "same", "same", "other", "foreign")))
        def validate(self, data: st.DataObject, requested: frozenset[str],
                     target_kind: str) -> None:
            minted: Minted = self._pick(data, self.minted)
            index = data.draw(st.integers(0, len(self.gateways) - 1))
            grant = minted.grant
            target = {"same": grant.identity, "foreign": self.foreign,
                      "other": self._pick(data, self.identities)}[target_kind]
            recognized = index == minted.gateway and self.generations[index] == (
                minted.generation)
            expected = self.oracle.validate(
                recognized=recognized, granted=grant.identity, target=target,
                connector_id=grant.connector_id, lease_id=grant.lease_id, epoch=grant.epoch,
                grant_scopes=frozenset(grant.scopes), grant_expires=minted.expires,
                requested=requested)
            result = self.gateways[index].validate(grant, identity=target, scopes=requested)
            assert result.reason == expected.reason, (result, expected)
            if result.context is not None:
                lease = self.oracle.leases[grant.identity]
                # The heart of fencing: only the current epoch's active lease validates.
                assert result.context.epoch == lease.epoch
                assert result.context.lease_id == lease.lease_id
                assert lease.state(self.oracle.now) == "active"
                assert result.context.scopes == tuple(sorted(requested))
            self._check_audit(expected, target,
                              grant.connector_id if recognized else "unrecognized", None)

        @rule(index=st.integers(0, 1))
        def restart_gateway(self, index: int) -> None:
            """A restarted gateway keeps the durable lease but none of its grants."""
            self.gateways[index] = self._gateway()
            self.generations[index] += 1

        @rule(seconds=st.sampled_from(STEPS))
        def advance_time(self, seconds: int) -> None:
            self.harness.advance(timedelta(seconds=seconds))
            self.oracle.now += seconds

        # -- invariants ---------------------------------------------------------------------

        @invariant()
        def store_agrees_and_old_epochs_are_dead(self) -> None:
            for identity in self.identities:
                snapshot = self.harness.store.load(identity)
                model = self.oracle.leases.get(identity)
                if model is None:
                    assert snapshot.row is None
                    continue
                row = snapshot.row
                assert row is not None
                assert (row.epoch, row.lease_id, row.connector_id) == (
                    model.epoch, model.lease_id, model.connector_id)
                assert row.state(snapshot.now).value == model.state(self.oracle.now)
                assert row.epoch >= self.highest_epoch.get(identity, 0), "epoch went back"
                self.highest_epoch[identity] = row.epoch
                live_epochs: set[tuple[int, UUID]] = set()
                for minted in self.minted:
                    grant = minted.grant
                    if grant.identity != identity:
                        continue
                    usable = grant_refusal(
                        row, snapshot.now, connector_id=grant.connector_id,
                        lease_id=grant.lease_id, epoch=grant.epoch,
                        granted_scopes=grant.scopes, grant_expires_at=grant.expires_at,
                        requested=()) is None
                    if usable:
                        live_epochs.add((grant.epoch, grant.lease_id))
                    if grant.epoch < row.epoch:
                        assert not usable, "a grant of an older epoch is still usable"
                assert len(live_epochs) <= 1, f"two epochs valid at once: {live_epochs}"

    LeaseMachine.__name__ = "LeaseMachine"
    return LeaseMachine


__all__ = ["POLICY", "make_lease_machine"]
