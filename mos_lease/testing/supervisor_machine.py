"""The executable specification of the supervisor: a Hypothesis state machine that runs
several bindings in one :class:`~mos_lease.supervisor.Supervisor` against any store.

A rival gateway takes bindings over (preempting active leases), releases what it took and
acquires identities first; the supervisor's store fails and recovers; notices (true ones and
forged ones) arrive through one :class:`~mos_lease.testing.ManualNoticeFeed`; bindings are
added and removed; time passes on a manual clock, with the supervisor turning, or stalled.
After every step the machine checks:

* **one epoch valid at a time**: a lease the supervisor holds is never valid for longer
  than the store keeps it (its local deadline comes no later than the store's expiry), and
  once another epoch supersedes it, the supervisor stops holding it by its local deadline;
* **every loss reported once**: each lease is reported started once and lost at most once,
  in that order; what the reports say is held is exactly what the supervisor holds;
* **removed bindings are released** and never campaigned for again;
* **epochs only rise** in the store, and a grant the supervisor mints is for the current
  epoch's active lease.

The supervisor runs turn by turn (``background=False``) on a monotonic clock that moves
with the store's (``StoreHarness.advance``), so a failure shrinks to a readable program.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import uuid4

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.errors import StoreUnavailable
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.turn import IN_FLIGHT
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.policy import AllowAllPolicy
from mos_lease.records import LeaseHandle, Snapshot
from mos_lease.supervisor import BindingLost, BindingStarted, Change, Supervisor
from mos_lease.testing.harness import StoreHarness
from mos_lease.testing.notice_feed import ManualNoticeFeed
from mos_lease.vocabulary import LeaseState

SUPERVISOR = "gw-a"
RIVAL = "gw-b"
SCOPES = ("tool:run",)
TTLS = (10.5, 30.5)  # half seconds: never exactly on a step of the clock
STEP = 0.5  # seconds between the supervisor's turns while time runs
BINDINGS = 3
_NOTICE_WAIT = 5.0  # real seconds the notice confirmer's thread may take to start a turn


class _FlakyStore:
    """The store as the supervisor's coordinator sees it: every call fails while ``down``.
    Everything else is the store's own."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.down = False

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name.startswith("_") or not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise StoreUnavailable(f"{name}: the store is down (specification step)")
            return attribute(*args, **kwargs)

        return call


def make_supervisor_machine(harness_factory: Callable[[], StoreHarness], *,
                            in_flight: int = IN_FLIGHT) -> type[RuleBasedStateMachine]:
    """A state machine class running a supervisor of several bindings against stores from
    the factory. Use it as ``TestMySupervisor = make_supervisor_machine(factory).TestCase``.
    ``in_flight``: renewal batches of a tick the supervisor keeps in flight at once (both
    supervisors keep :data:`~mos_lease.keep.turn.IN_FLIGHT`, two: the next batch is
    primed while the last one's store call runs; one is the turn's other shape).
    """

    class SupervisorMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.harness = harness_factory()
            self.raw = self.harness.store
            self.flaky = _FlakyStore(self.raw)
            self.mono = 1000.0
            tenant = f"s-{uuid4().hex[:12]}"  # stores never delete: runs apart by tenant
            self.identities = [LeaseIdentity(tenant, f"agent-{k}", "b")
                               for k in range(BINDINGS)]
            self.coordinator = ConnectorLeaseCoordinator(self.flaky, AllowAllPolicy(),
                                                         monotonic_clock=self._clock)
            self.rival = ConnectorLeaseCoordinator(self.raw, AllowAllPolicy(),
                                                   monotonic_clock=self._clock)
            # A bound so wide that no turn waits for it: the machine decides when time moves.
            self.feed = ManualNoticeFeed(NoticeConfirmer(rate=1e9, burst=1_000_000,
                                                         clock=self._clock))
            self.reported: list[Change] = []
            self.sleeps = 0
            self.supervisor = Supervisor(self.coordinator, on_change=self.reported.append,
                                         clock=self._clock, sleep=self._sleep,
                                         random=lambda: 0.5, background=False,
                                         notices=self.feed)
            self.supervisor._in_flight = in_flight
            self.checked = 0  # reports checked so far
            self.held: dict[LeaseIdentity, LeaseHandle] = {}  # started, not yet lost
            self.started: set[Any] = set()  # lease ids reported started
            self.lost: set[Any] = set()  # lease ids reported lost
            self.last_epoch: dict[LeaseIdentity, int] = {}
            self.removed: dict[LeaseIdentity, int] = {}  # epoch of the row at removal
            self.rival_leases: dict[LeaseIdentity, LeaseHandle] = {}
            self.highest: dict[LeaseIdentity, int] = {}  # the store's epochs seen
            # Where the store's clock and the supervisor's start. A store whose time also
            # runs on its own (PostgreSQL's) drifts ahead of the manual clock by the real
            # time the run takes; see one_epoch_valid_at_a_time.
            self.wall0, self.mono0 = self.raw.load(self.identities[0]).now, self.mono

        # -- the clock and the supervisor's turns -------------------------------------------

        def _clock(self) -> float:
            return self.mono

        def _sleep(self, _seconds: float) -> None:
            self.sleeps += 1

        def _advance(self, seconds: float) -> None:
            self.mono += seconds
            self.harness.advance(timedelta(seconds=seconds))

        def _settle(self) -> None:
            """Turn until the supervisor has nothing to do at this instant."""
            for _ in range(10_000):
                before = self.sleeps
                self.supervisor.turn()
                if self.sleeps > before:
                    return
            raise AssertionError("the supervisor never went to sleep")

        def _load(self, identity: LeaseIdentity) -> Snapshot:
            return self.raw.load(identity)

        def _slots(self) -> dict[LeaseIdentity, Any]:
            # The supervisor's own record of each binding: the deadline it judges by is
            # what the safety invariant is about, and no public call shows it unjudged.
            return self.supervisor._core.schedule.slots

        def teardown(self) -> None:
            self.flaky.down = False
            self.supervisor.close()

        # -- the gateway's calls -------------------------------------------------------------

        @rule(k=st.integers(0, BINDINGS - 1), ttl=st.sampled_from(TTLS))
        def add(self, k: int, ttl: float) -> None:
            identity = self.identities[k]
            if identity in self._slots():
                return
            self.supervisor.add(identity, SUPERVISOR, scopes=SCOPES, ttl=ttl)
            self.removed.pop(identity, None)
            self._settle()

        @rule(k=st.integers(0, BINDINGS - 1))
        def remove(self, k: int) -> None:
            identity = self.identities[k]
            if identity not in self._slots():
                return
            slot = self._slots()[identity]
            holding = slot.state.lease if slot.holding else None
            try:
                result = self.supervisor.remove(identity)
            except StoreUnavailable:
                assert self.flaky.down and holding is not None
                result = None
            assert identity not in self.supervisor.bindings
            row = self._load(identity).row
            self.removed[identity] = 0 if row is None else row.epoch
            if holding is not None and not self.flaky.down:
                # A lease held when its binding is removed is given back at once.
                assert result is not None, "a held lease was not released on removal"
                assert row is not None
                if result.ok:
                    assert row.released_at is not None and row.lease_id == holding.lease_id
                elif row.lease_id == holding.lease_id:
                    # Refused only if the store no longer counts it as the holder's.
                    assert row.state(self._load(identity).now) is not LeaseState.ACTIVE

        @rule(k=st.integers(0, BINDINGS - 1))
        def issue_grant(self, k: int) -> None:
            identity = self.identities[k]
            if identity not in self._slots():
                return
            try:
                result = self.supervisor.issue_grant(identity, scopes=SCOPES, ttl=5)
            except StoreUnavailable:
                assert self.flaky.down
                return
            if result.grant is None:
                return
            snapshot = self._load(identity)
            row = snapshot.row
            # Fencing: a grant is minted only for the current epoch's active lease.
            assert row is not None and (row.epoch, row.lease_id) == (
                result.grant.epoch, result.grant.lease_id)
            assert row.state(snapshot.now) is LeaseState.ACTIVE

        # -- the world around it -------------------------------------------------------------

        @rule(k=st.integers(0, BINDINGS - 1), ttl=st.sampled_from(TTLS))
        def rival_takes_over(self, k: int, ttl: float) -> None:
            identity = self.identities[k]
            row = self._load(identity).row
            if row is None:
                result = self.rival.acquire(identity, RIVAL, scopes=SCOPES, ttl=ttl)
            else:
                result = self.rival.takeover(identity, RIVAL, scopes=SCOPES, ttl=ttl,
                                             expected_epoch=row.epoch)
            if result.lease is not None:
                self.rival_leases[identity] = result.lease

        @precondition(lambda self: bool(self.rival_leases))
        @rule(k=st.integers(0, BINDINGS - 1))
        def rival_releases(self, k: int) -> None:
            lease = self.rival_leases.pop(self.identities[k], None)
            if lease is not None:
                self.rival.release(lease)

        @rule(k=st.integers(0, BINDINGS - 1), forged=st.booleans(),
              kind=st.sampled_from(("takeover", "release")))
        def notice(self, k: int, forged: bool, kind: str) -> None:
            identity = self.identities[k]
            row = self._load(identity).row
            epoch = (0 if row is None else row.epoch) + (7 if forged else 0)
            core = self.supervisor._core
            with core.lock:
                # A held binding's notice takes a confirming turn; a waiting binding's only
                # moves its next read (Schedule.look), on the notice's own thread.
                slot = core.schedule.slots.get(identity)
                worth = (slot is not None and slot.holding
                         and core.schedule.worth_confirming(identity, max(epoch, 1)))
            self.feed.send(identity, max(epoch, 1), kind)
            if worth:  # wait for the confirmer's thread to hand the turn over
                slot = self._slots()[identity]
                end = time.monotonic() + _NOTICE_WAIT
                while slot not in core.confirming and not slot.removed:
                    assert time.monotonic() < end, "the notice confirmer never took it"
                    time.sleep(0.001)
            self._settle()

        @rule(down=st.booleans())
        def store_fails_or_recovers(self, down: bool) -> None:
            self.flaky.down = down
            self._settle()

        @rule(seconds=st.sampled_from((0.5, 1.0, 3.0, 8.0)))
        def time_passes(self, seconds: float) -> None:
            for _ in range(math.ceil(seconds / STEP)):
                self._advance(STEP)
                self._settle()

        @rule(seconds=st.sampled_from((4.0, 12.0, 31.0)))
        def process_stalls(self, seconds: float) -> None:
            """The process does not run for ``seconds`` (a pause, a swap storm)."""
            self._advance(seconds)
            self._settle()

        # -- invariants ----------------------------------------------------------------------

        @invariant()
        def every_loss_is_reported_once(self) -> None:
            for change in self.reported[self.checked:]:
                if isinstance(change, BindingStarted):
                    lease = change.lease
                    assert change.identity not in self.held, f"started twice: {change}"
                    assert lease.lease_id not in self.started, f"reported again: {change}"
                    assert lease.epoch > self.last_epoch.get(change.identity, 0)
                    self.held[change.identity] = lease
                    self.started.add(lease.lease_id)
                    self.last_epoch[change.identity] = lease.epoch
                elif isinstance(change, BindingLost):
                    # Compared by lease id: a renewal hands back the same lease, later expiry.
                    was = self.held.pop(change.identity, None)
                    assert was is not None and was.lease_id == change.lease.lease_id, \
                        f"lost what was not reported held: {change}"
                    assert change.lease.lease_id not in self.lost
                    self.lost.add(change.lease.lease_id)
            self.checked = len(self.reported)
            holding = {identity: slot.state.lease.lease_id
                       for identity, slot in self._slots().items() if slot.holding}
            reported = {identity: lease.lease_id for identity, lease in self.held.items()}
            assert holding == reported, "what is reported held is not what is held"

        @invariant()
        def one_epoch_valid_at_a_time(self) -> None:
            for identity, slot in self._slots().items():
                if not slot.holding:
                    continue
                lease, deadline = slot.state.lease, slot.state.deadline
                snapshot = self._load(identity)
                row = snapshot.row
                assert row is not None and row.epoch >= lease.epoch
                if row.lease_id == lease.lease_id:
                    # Held no longer than the store keeps it valid (what the safety margin
                    # is for): the local deadline comes before the store's expiry. The
                    # store's own drift ahead of the manual clock is what a real clock of
                    # the supervisor would have moved too (none for a manual store).
                    left = (row.expires_at - snapshot.now).total_seconds()
                    drift = ((snapshot.now - self.wall0).total_seconds()
                             - (self.mono - self.mono0))
                    assert row.released_at is None
                    assert deadline - self.mono <= left + max(drift, 0.0), (
                        deadline - self.mono, left, drift)
                else:
                    # Superseded: held only until its local deadline, never beyond.
                    assert self.mono < deadline

        @invariant()
        def removed_bindings_are_released_and_left_alone(self) -> None:
            for identity, epoch in self.removed.items():
                assert identity not in self._slots()
                row = self._load(identity).row
                if row is not None and row.epoch > epoch:
                    assert row.connector_id != SUPERVISOR, "campaigned after its removal"

        @invariant()
        def epochs_only_rise(self) -> None:
            for identity in self.identities:
                row = self._load(identity).row
                if row is not None:
                    assert row.epoch >= self.highest.get(identity, 0), "epoch went back"
                    assert row.epoch >= self.last_epoch.get(identity, 0)
                    self.highest[identity] = row.epoch

    SupervisorMachine.__name__ = ("SupervisorMachine" if in_flight == IN_FLIGHT
                                  else f"SupervisorMachine{in_flight}InFlight")
    return SupervisorMachine


__all__ = ["make_supervisor_machine"]
