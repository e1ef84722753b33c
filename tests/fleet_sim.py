"""A fleet member driven by the campaign gate over real leases, for the fleet tests on the
memory store and on PostgreSQL: it reads every binding in one call, judges what it saw with
its own view of the member set, campaigns where the gate says so (acquire, or takeover at
the observed epoch) and renews what it holds. The policy it is given may allow preempting
an active lease: the gate must never ask for that, and :meth:`SimMember.turn` asserts it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.fleet.gate import Held, Observed, Unheld, gates
from mos_lease.fleet.placement import place
from mos_lease.ports import LeaseStore
from mos_lease.records import LeaseHandle
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState


class SimMember:
    def __init__(self, name: str, view: set[str], store: LeaseStore,
                 now: Callable[[], datetime], bindings: Sequence[LeaseIdentity],
                 grace: timedelta) -> None:
        self.name = name
        self.view = view | {name}
        self.now = now  # the store's time
        self.bindings = list(bindings)
        self.grace = grace
        self.coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        self.held: dict[LeaseIdentity, LeaseHandle] = {}
        self.first_unheld: dict[LeaseIdentity, datetime] = {}
        self.takeovers = 0

    def observe(self, view: HolderView | None, identity: LeaseIdentity,
                now: datetime) -> Observed:
        if view is not None and view.state is LeaseState.ACTIVE:
            holder = view.connector_id
            return Held(holder if holder in self.view else None, view.expires_at)
        if view is None:
            return Unheld(self.first_unheld.setdefault(identity, now))
        return Unheld(min(view.expires_at, self.first_unheld.setdefault(identity, now)))

    def turn(self, ttl: float) -> None:
        now = self.now()
        views = self.coordinator.current_holders(self.bindings)
        observed = {b: self.observe(v, b, now)
                    for b, v in zip(self.bindings, views, strict=True)}
        for binding, seen in observed.items():
            if isinstance(seen, Held):
                self.first_unheld.pop(binding, None)
        decided = gates(place(self.view, self.bindings), self.name, observed, now, self.grace)
        for (binding, decision), view in zip(decided.items(), views, strict=True):
            if not decision.campaign:
                continue
            if view is None:
                got = self.coordinator.acquire(binding, self.name, scopes=[], ttl=ttl)
            else:
                # The policy would allow preempting an active lease: the gate must not ask.
                assert view.state is not LeaseState.ACTIVE, (self.name, binding, view)
                got = self.coordinator.takeover(binding, self.name, scopes=[], ttl=ttl,
                                                expected_epoch=view.epoch, observed=view)
                self.takeovers += got.ok
            if got.lease is not None:
                self.held[binding] = got.lease
        for binding, lease in list(self.held.items()):
            renewed = self.coordinator.heartbeat(lease, ttl=ttl)
            if renewed.lease is None:
                del self.held[binding]
            else:
                self.held[binding] = renewed.lease
