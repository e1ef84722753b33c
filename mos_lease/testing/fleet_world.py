"""What the fleet's stateful specification (:mod:`mos_lease.testing.fleet_machine`) runs its
members in: a policy that allows everything and records each takeover asked of an active
lease (a fleet never preempts, whatever the policy would allow), a store view that can go
stale on the member leases (a member that disagrees with the others about who is live),
a tenant of its own on a shared store, the audit log as read so far, and one member
process: its supervisor, what it reported and what it checked so far.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any
from uuid import UUID

from mos_lease.grants import ExecutionGrant
from mos_lease.identity import LeaseIdentity
from mos_lease.machine import ALLOW, PolicyVerdict
from mos_lease.policy import PolicyRequest
from mos_lease.records import AuditEntry, LeaseHandle, Snapshot
from mos_lease.supervisor import BindingLost, BindingStarted, Change, Moved, Supervisor
from mos_lease.testing.harness import InspectableStore
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome


class RecordingPolicy:
    """Allows every call, and records each takeover asked of a lease active at its time."""

    def __init__(self) -> None:
        self.preemptions: list[PolicyRequest] = []

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        if request.event is LifecycleEvent.TAKEOVER \
                and request.current_state is LeaseState.ACTIVE:
            self.preemptions.append(request)
        return ALLOW


class StaleView:
    """The store as one member sees it: the store's own, except that while ``frozen`` is
    set, a read of member leases alone (the member read of each look) answers what it
    answered when the view froze. Such a member goes on seeing members that left or
    crashed, and never sees the ones that joined since: its placement is not the others'."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.frozen: list[Snapshot] | None = None
        self._frozen_for: tuple[LeaseIdentity, ...] = ()

    def freeze(self, identities: Sequence[LeaseIdentity]) -> None:
        self._frozen_for = tuple(identities)
        self.frozen = list(self._inner.load_many(self._frozen_for))

    def thaw(self) -> None:
        self.frozen = None

    def load_many(self, identities: Sequence[LeaseIdentity]) -> Sequence[Snapshot]:
        if self.frozen is not None and tuple(identities) == self._frozen_for:
            return list(self.frozen)
        answer: Sequence[Snapshot] = self._inner.load_many(identities)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class AuditTrail:
    """The audit rows of ``watched`` read so far: each acquire and takeover names the epoch
    after the last (:attr:`epochs`), and the releases are kept by identity and epoch
    (:attr:`releases`) for the moves to be found."""

    def __init__(self, store: InspectableStore, watched: Sequence[LeaseIdentity]) -> None:
        self._store, self._watched = store, list(watched)
        self._seq: dict[LeaseIdentity, int] = {}  # read up to, by identity
        self.epochs: dict[LeaseIdentity, int] = {}  # last acquire or takeover audited
        self.releases: dict[tuple[LeaseIdentity, int], AuditEntry] = {}

    def read(self) -> None:
        """The rows written since the last read (by identity: a shared store holds other
        runs' too)."""
        for identity in self._watched:
            while records := self._store.audit(identity, limit=1000,
                                               after_seq=self._seq.get(identity, 0)):
                self._seq[identity] = records[-1].seq
                for record in records:
                    self._audited(record.entry)

    def _audited(self, entry: AuditEntry) -> None:
        if entry.outcome in (Outcome.ACQUIRED, Outcome.TAKEN_OVER):
            last = self.epochs.get(entry.identity, 0)
            assert entry.epoch == last + 1, (entry.identity, last, entry.epoch)
            self.epochs[entry.identity] = last + 1
        elif entry.outcome is Outcome.RELEASED and entry.epoch is not None:
            self.releases[(entry.identity, entry.epoch)] = entry


def free_tenant(store: InspectableStore) -> str:
    """A tenant (and fleet name) no lease of ``store`` has. Stores never delete, so runs on
    a shared store keep apart by tenant; the placement hashes the identities, so a fresh
    store gets the same one every run (a failure replays as it was found)."""
    for suffix in itertools.count():
        tenant = f"fleet-spec-{suffix}"
        if not store.leases(tenant):
            return tenant
    raise AssertionError("unreachable")


class MemberProcess:
    """One member's process while it runs: its supervisor, the store view it reads through,
    what it reported (``reported``), the leases those reports say it holds (``held``), and
    the grants it minted that have not expired (``grants``), and which of them were refused
    (``refused``: a grant refused once is never valid again)."""

    def __init__(self, name: str, configured: frozenset[str], weight: float,
                 view: StaleView, make: Callable[[list[Change]], Supervisor]) -> None:
        self.name = name
        self.configured = configured
        self.weight = weight
        self.view = view
        self.reported: list[Change] = []
        self.supervisor = make(self.reported)
        self.checked = 0
        self.held: dict[LeaseIdentity, LeaseHandle] = {}
        self.grants: dict[LeaseIdentity, list[ExecutionGrant]] = {}
        self.refused: set[UUID] = set()
        self.paused = False

    def slots(self) -> dict[LeaseIdentity, Any]:
        # The supervisor's own record of each binding: the local deadline it judges by is
        # what exclusivity is about, and no public call shows it unjudged.
        slots: dict[LeaseIdentity, Any] = self.supervisor._core.schedule.slots
        return slots

    def holding(self, now: float) -> dict[LeaseIdentity, tuple[LeaseHandle, float]]:
        """What this member counts as its own at ``now``: each lease with its local
        deadline, not yet past (after it, no grant is minted for it)."""
        return {identity: (slot.state.lease, slot.state.deadline)
                for identity, slot in self.slots().items()
                if slot.holding and now < slot.state.deadline}

    def handable(self, now: float, bindings: Sequence[LeaseIdentity]) -> list[LeaseIdentity]:
        """The ``bindings`` it could hand over at ``now``: held, not being handed over."""
        slots = self.slots()
        return sorted((identity for identity in self.holding(now)
                       if identity in bindings and not slots[identity].handing), key=str)

    def preferred(self, identity: LeaseIdentity) -> str | None:
        """The member its placement prefers for ``identity``."""
        fleet = self.supervisor._core.schedule.fleet
        return None if fleet is None else fleet.placement.preferred(identity)

    def new_reports(self) -> list[Change]:
        """The reports not checked yet, each checked against what the reports before it
        said was held: a start of a lease not held, an end (lost, or moved) of the lease
        held."""
        new = self.reported[self.checked:]
        self.checked = len(self.reported)
        for change in new:
            if isinstance(change, BindingStarted):
                assert change.identity not in self.held, f"{self.name} started twice: {change}"
                self.held[change.identity] = change.lease
            elif isinstance(change, BindingLost | Moved):
                was = self.held.pop(change.identity, None)
                assert was is not None and was.lease_id == change.lease.lease_id, \
                    f"{self.name} ended what it was not reported holding: {change}"
        return new
