"""Two fleet members that disagree about the member set (each sees only itself, so each
prefers every binding to itself) campaigning for the same bindings at once, for the tests
on the in-memory store and on PostgreSQL.

The supervisors turn by hand, one turn each in alternation, so that one member's holder
read and its write have the other's between them: both read a binding unheld, both write,
and the store lets one win (an acquire is insert-only, a takeover a compare-and-set on the
observed epoch). A turn makes the takeovers its reads decide right after them, so before
each member's takeover the other member turns once more, its read and write included: the
two writes of one epoch meet there. Both stall at once past the ttl, so that both find
every lease expired and take over together. At every step each member mints a grant for
every binding it counts as its own, and every grant minted so far is validated: at most one
per binding is valid, the store's current epoch's, and every grant of an older epoch is
refused; at most one member counts a binding as its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.fleet.membership import Fleet
from mos_lease.grants import ExecutionGrant
from mos_lease.ports import LeaseStore
from mos_lease.records import AuditRecord
from mos_lease.supervisor import Supervisor
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome, Reason

TTL, STEP = 6.5, 0.5
T = TypeVar("T")
SCOPES = ["tool:run"]


class Race:
    """``stores``: each member's own store (connection) on one database; ``clock``: the
    supervisors' monotonic clock; ``advance(seconds)``: time passes for the store and the
    clock alike."""

    def __init__(self, fleet: str, stores: Mapping[str, LeaseStore],
                 bindings: Sequence[LeaseIdentity], clock: Callable[[], float],
                 advance: Callable[[float], None]) -> None:
        self.bindings = list(bindings)
        self.advance = advance
        self.stores = dict(stores)
        self.members: dict[str, Supervisor] = {}
        self._between = False  # the other member's turn before a takeover is under way
        for name, store in stores.items():
            coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy(),
                                                    monotonic_clock=clock)
            coordinator.takeover_many = self._after_the_other(  # type: ignore[method-assign]
                name, coordinator.takeover_many)
            supervisor = Supervisor(
                coordinator,
                clock=clock, background=False, sleep=lambda _: None, random=lambda: 0.5,
                fleet=Fleet(fleet, name, members=[name], ttl=TTL, look=1.0, grace=2.0))
            for identity in self.bindings:
                supervisor.add(identity, name, scopes=SCOPES, ttl=TTL)
            self.members[name] = supervisor
        # The latest grant of each member's lease of each binding.
        self.grants: dict[tuple[str, LeaseIdentity, int], ExecutionGrant] = {}
        self.valid_seen: Counter[str] = Counter()  # grants found valid, by member
        self.older_refused = 0
        self.refused: set[int] = set()  # grants kept in self.grants, refused once

    def _after_the_other(self, name: str, takeover_many: Callable[..., T]
                         ) -> Callable[..., T]:
        """``takeover_many`` of member ``name``, made after the other member's turn."""
        def made(*args: Any, **kwargs: Any) -> T:
            if not self._between:
                self._between = True
                try:
                    for other, supervisor in self.members.items():
                        if other != name:
                            supervisor.turn()
                finally:
                    self._between = False
            return takeover_many(*args, **kwargs)
        return made

    def run(self, seconds: float) -> None:
        """Time passes; both members turn in alternation at each step (the first to turn
        changes from step to step), checked after each turn."""
        names = list(self.members)
        for step in range(round(seconds / STEP)):
            self.advance(STEP)
            order = names[step % len(names):] + names[:step % len(names)]
            for _ in range(3):
                for name in order:
                    supervisor = self.members[name]
                    supervisor.turn()
                    self.mint(name)
                    self.check()

    def stall(self, seconds: float) -> None:
        """Neither member runs for ``seconds`` (both processes stall, or the host does)."""
        self.advance(seconds)
        self.check()

    def mint(self, name: str) -> None:
        supervisor = self.members[name]
        for identity in self.bindings:
            if supervisor.lease(identity) is not None:
                issued = supervisor.issue_grant(identity, scopes=SCOPES, ttl=5)
                if issued.grant is not None:
                    self.grants[(name, identity, issued.grant.epoch)] = issued.grant

    def check(self) -> None:
        owners: Counter[LeaseIdentity] = Counter(
            identity for supervisor in self.members.values() for identity in self.bindings
            if supervisor.lease(identity) is not None)
        assert max(owners.values(), default=0) <= 1, f"held by both members at once: {owners}"
        valid: dict[LeaseIdentity, set[tuple[str, int]]] = {}
        for (name, identity, _), grant in self.grants.items():
            row = self.stores[name].load(identity).row
            assert row is not None
            checked = self.members[name].coordinator.validate(grant, identity=identity,
                                                              scopes=SCOPES)
            if checked.ok:
                assert (grant.epoch, grant.lease_id) == (row.epoch, row.lease_id)
                assert id(grant) not in self.refused, "a refused grant validated again"
                valid.setdefault(identity, set()).add((name, grant.epoch))
                self.valid_seen[name] += 1
                continue
            if grant.epoch < row.epoch:
                # Taken over only after its lease expired, so the grant has expired too:
                # said first (a release ends a lease before its grants: stale_epoch).
                assert checked.reason in (Reason.GRANT_EXPIRED, Reason.STALE_EPOCH), checked
                self.older_refused += 1
            self.refused.add(id(grant))
        both = {identity: seen for identity, seen in valid.items() if len(seen) > 1}
        assert not both, f"two epochs valid at once: {both}"

    def epochs_step_by_one(self, audit: Callable[[LeaseIdentity], Sequence[AuditRecord]]
                           ) -> tuple[Counter[LeaseIdentity], Counter[LeaseIdentity]]:
        """Every acquire and takeover of a binding in the audit log names the epoch after
        the last. The takeovers per binding, and the takeovers refused (a loser's)."""
        taken: Counter[LeaseIdentity] = Counter()
        refused: Counter[LeaseIdentity] = Counter()
        for identity in self.bindings:
            entries = [record.entry for record in audit(identity)]
            won = [e.epoch for e in entries
                   if e.outcome in (Outcome.ACQUIRED, Outcome.TAKEN_OVER)]
            assert won == list(range(1, len(won) + 1)), (identity, won)
            taken[identity] = sum(e.outcome is Outcome.TAKEN_OVER for e in entries)
            refused[identity] = sum(e.event is LifecycleEvent.TAKEOVER
                                    and e.outcome is Outcome.DENIED for e in entries)
        return taken, refused

    def holders(self) -> Counter[str | None]:
        """Who holds each binding now (``None``: nobody)."""
        reader = ConnectorLeaseCoordinator(next(iter(self.stores.values())), AllowAllPolicy())
        return Counter(None if view is None or view.state is not LeaseState.ACTIVE
                       else view.connector_id for view in reader.current_holders(self.bindings))

    def play(self, audit: Callable[[LeaseIdentity], Sequence[AuditRecord]]) -> None:
        """Both members start at once, then both stall past the ttl and resume at once;
        checked throughout (:meth:`check`), and at the end: every binding held by one of
        them, taken over once after the stall, older grants refused."""
        self.run(3)
        assert set(self.holders()) <= set(self.members), self.holders()
        taken_before, refused_before = self.epochs_step_by_one(audit)
        self.stall(TTL + 1)
        self.run(3)
        holders = self.holders()
        assert None not in holders and sum(holders.values()) == len(self.bindings), holders
        taken, refused = self.epochs_step_by_one(audit)
        once = Counter(dict.fromkeys(self.bindings, 1))
        # Both took each binding over at the epoch both read: one write won, one was refused.
        assert taken - taken_before == once, taken - taken_before
        assert refused - refused_before == once, refused - refused_before
        assert self.older_refused > 0 and sum(self.valid_seen.values()) > 0

    def close(self) -> None:
        for supervisor in self.members.values():
            supervisor.close()
