"""What the two supervisors share: checking the coordinator they are given, registering and
removing bindings, reading the lease held for one, the core their turns run on, and the one
notice listener (``notices=``, :mod:`~mos_lease.keep.notices`).
:class:`~mos_lease.keep.runner.Supervisor` runs the turns of ``turn.py`` on one thread,
:class:`~mos_lease.keep.runner.AsyncSupervisor` as one asyncio task; each only performs
the calls a turn yields, which is where threads and asyncio differ.
"""

from __future__ import annotations

import logging
import math
import random as _random
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar

from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator
from mos_lease.errors import ConfigurationError, InvalidInput
from mos_lease.events import EventHook, emitter
from mos_lease.fleet.membership import Fleet, FleetStatus, Membership
from mos_lease.identity import (
    LeaseIdentity,
    check_id,
    check_identity,
    normalize_scopes,
    normalize_ttl,
)
from mos_lease.keep.campaign import TakeoverPolicy, check_takeover, check_wait
from mos_lease.keep.changes import Change
from mos_lease.keep.notices import NoticeFeed, SupervisorNotices, check_feed
from mos_lease.keep.schedule import BATCH
from mos_lease.keep.slots import Binding
from mos_lease.keep.timing import timing_over
from mos_lease.keep.turn import IN_FLIGHT, Core
from mos_lease.metadata import check_metadata
from mos_lease.records import LeaseHandle
from mos_lease.results import LeaseResult
from mos_lease.stats import SupervisorCounts, SupervisorStats

C = TypeVar("C", ConnectorLeaseCoordinator, AsyncConnectorLeaseCoordinator)

log = logging.getLogger("mos_lease.supervisor")

_CLOSED: Any = None  # what a listener is sent when the supervisor closes


def _binding(store: object, identity: LeaseIdentity, connector_id: str, scopes: object,
             ttl: float | timedelta, options: dict[str, float | None],
             metadata: object = None, takeover: object = TakeoverPolicy.EXPIRED,
             wait: object = None, once: object = False) -> Binding:
    return Binding(check_identity("identity", identity), check_id("connector_id", connector_id),
                   normalize_scopes("scopes", scopes), timing_over(store, ttl, **options),
                   check_metadata("metadata", metadata), check_takeover(takeover),
                   check_wait(wait), _flag("once", once))


def _held(lease: object, obtained_at: object, identity: LeaseIdentity,
          connector_id: str) -> tuple[LeaseHandle, float] | None:
    """``add()``'s ``held`` and ``obtained_at``, checked: both or neither, a handle of the
    binding's own identity and connector, a finite clock reading."""
    if lease is None and obtained_at is None:
        return None
    if not isinstance(lease, LeaseHandle):
        raise InvalidInput("held", f"must be a LeaseHandle, not {type(lease).__name__}")
    if lease.identity != identity or lease.connector_id != connector_id:
        raise InvalidInput("held", "must be a lease of the binding's identity and connector")
    if isinstance(obtained_at, bool) or not isinstance(obtained_at, int | float) \
            or not math.isfinite(obtained_at):
        raise InvalidInput("obtained_at", "must be the clock's reading before the call "
                           "that won the lease")
    return lease, float(obtained_at)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(name, f"must be True or False, not {type(value).__name__}")
    return value


RENEWERS = IN_FLIGHT
"""The most renewal coordinators a supervisor takes (``heartbeat_coordinator=``): one per
batch a tick keeps in flight with one connection."""


class _Supervisor(Generic[C]):
    """What both supervisors share: registering, reading, and the core."""

    _kind: type[C]
    _in_flight: int  # renewal batches of a tick in flight at once (the runner's)
    _sleep: Any  # the driver's pause: injected, or its own (_real_sleep)

    def __init__(self, coordinator: C, *,
                 on_change: Callable[[Change], object] | None = None,
                 clock: Callable[[], float] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True, notices: NoticeFeed | None = None,
                 heartbeat_coordinator: C | Sequence[C] | None = None,
                 on_event: EventHook | None = None, fleet: Fleet | None = None) -> None:
        if not isinstance(coordinator, self._kind):
            raise ConfigurationError(f"{type(self).__name__} needs a {self._kind.__name__} as "
                                     f"coordinator, not {type(coordinator).__name__}")
        if on_change is not None and not callable(on_change):
            raise ConfigurationError("on_change must be callable")
        self.coordinator: C = coordinator
        # The renewals go through these (connections of their own, say, so that a renewal
        # stuck on one cannot hold up the grants and campaign calls of ``coordinator``),
        # batch by batch in turn: two batches of a tick in flight on two connections run at
        # once, where one connection would run them one after the other.
        self.renewers: tuple[C, ...] = self._renewers(coordinator, heartbeat_coordinator)
        self._renewed_on = 0  # the index in renewers of the last batch's
        # One batch more in flight per renewal connection more: while the supervisor judges
        # one batch's results, each connection still has a statement to run (asyncio, 10,000
        # bindings on two connections: 31,300-33,400 leases/s with two in flight,
        # 33,900-37,700 with three).
        self._in_flight = type(self)._in_flight + len(self.renewers) - 1
        # Counted by the driver where each call is made (mos_lease.stats).
        self._counts = SupervisorCounts()
        # Deadlines are kept on the coordinator's monotonic clock unless told otherwise.
        self._core = Core(clock if clock is not None else coordinator.monotonic, random,
                          on_change, emitter(on_event))
        self._background = background
        self._name = "mos-lease-supervisor"  # of its thread or task (start() may rename it)
        if fleet is not None:
            self._join(fleet)
        feed = check_feed(notices)
        self._core.schedule.noticed = feed is not None
        # One subscription for every binding, made last: a notice may come at once.
        self._notices = (None if feed is None
                         else SupervisorNotices(feed, self._core, self._wake_from_thread,
                                                self._counts))

    def _renewers(self, coordinator: C, given: object) -> tuple[C, ...]:
        """``heartbeat_coordinator`` checked: none (renew through ``coordinator``), one
        coordinator, or a sequence of one or two distinct ones (a batch in flight on each)."""
        if given is None:
            return (coordinator,)
        many = given if isinstance(given, Sequence) else (given,)
        for item in many:
            if not isinstance(item, self._kind):
                raise ConfigurationError(f"{type(self).__name__} needs a {self._kind.__name__}"
                                         f" or a sequence of them as heartbeat_coordinator, "
                                         f"not {type(item).__name__}")
        if not 1 <= len(many) <= RENEWERS or len(set(map(id, many))) != len(many):
            raise ConfigurationError(
                f"heartbeat_coordinator: one coordinator, or 1 to {RENEWERS} distinct ones "
                f"(a renewal batch in flight on each), not {len(many)}")
        return tuple(many)

    def _next_renewer(self, stuck: Callable[[C], bool]) -> C:
        """The coordinator of the next renewal batch: each renewer in turn, passing over
        one on which a batch given up on is still running (``stuck``), unless every one
        is. (Its connection hangs, say: a batch sent there would wait behind the hung
        statement and lose its leases at their deadlines, tick after tick, while the other
        connection could renew them.)"""
        count = len(self.renewers)
        turns = [(self._renewed_on + step) % count for step in range(1, count + 1)]
        self._renewed_on = next((i for i in turns if not stuck(self.renewers[i])),
                                turns[0])
        return self.renewers[self._renewed_on]

    def _join(self, fleet: Fleet) -> None:
        """Run ``fleet``'s member lease as one more binding, renewed in the batches of the
        others, and gate every other binding's campaign by the fleet (:mod:`mos_lease.
        supervisor.fleet`). The lease is campaigned for once the supervisor runs (its first
        ``add()``, or ``turn()`` by hand)."""
        if not isinstance(fleet, Fleet):
            raise ConfigurationError(f"fleet must be a Fleet, not {type(fleet).__name__}")
        member = _binding(self.coordinator.store, fleet.identity, fleet.member, (), fleet.ttl,
                          {"jitter": 0.0}, fleet.metadata)
        schedule = self._core.schedule
        schedule.fleet = Membership(fleet)
        schedule.add(member, self._core.clock())

    def fleet_status(self) -> FleetStatus | None:
        """What this member sees of its fleet (``None`` without ``fleet=``): the live
        members, the bindings it holds and is preferred for, those without a holder, and
        its hand-offs and takeovers (:class:`~mos_lease.fleet.membership.FleetStatus`)."""
        with self._core.lock:
            schedule = self._core.schedule
            if schedule.fleet is None:
                return None
            held = [slot.binding.identity for slot in schedule.slots.values() if slot.holding]
            return schedule.fleet.status(held, self._core.clock())

    def add(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
            ttl: float | timedelta, safety_margin: float | None = None,
            clock_step: float | None = None, renew_fraction: float | None = None,
            jitter: float = 0.0, min_backoff: float | None = None,
            max_backoff: float | None = None,
            metadata: Mapping[str, str] | None = None,
            takeover: TakeoverPolicy | str = TakeoverPolicy.EXPIRED,
            wait: float | None = None, once: bool = False,
            held: LeaseHandle | None = None, obtained_at: float | None = None) -> None:
        """Run ``identity`` as ``connector_id``: campaign for its lease, hold it, and
        campaign again after a loss, until ``remove()`` or ``close()``. The timing
        options are :class:`~mos_lease.keeper.KeeperTiming`'s (``docs/keeping.md``), except
        that ``jitter`` defaults to 0: a process's renewals are meant to go out together,
        and ``clock_step`` to 0 over a store that cannot fail over (the in-memory store).
        A ``ttl`` too short for the default safety margin raises
        :class:`~mos_lease.errors.ConfigurationError` naming ``safety_margin`` and
        ``clock_step``. ``metadata`` is the holder metadata every acquire and takeover of
        this binding sets (where to route its requests, say); checked here, like every other
        argument. ``takeover`` is :func:`~mos_lease.hold`'s policy
        (:class:`~mos_lease.keep.campaign.TakeoverPolicy`). ``wait``: seconds the first
        campaign may take; when they run out, or at once on a refusal that waiting cannot
        change (the policy's, an exhausted epoch), the binding gives up: it is reported as
        :class:`~mos_lease.keep.changes.GaveUp` and no longer run. ``None`` (the
        default): campaign until removed, whatever is refused. ``once``: hold the lease
        once, as :func:`~mos_lease.hold` does: its loss (reported as
        :class:`~mos_lease.keep.changes.BindingLost`) ends the binding, which is then
        no longer run, instead of starting a new campaign; and a refusal that waiting cannot
        change gives it up at once, even without a ``wait``. ``held``: the binding holds this
        lease already, won by a call the caller made (an acquire or a takeover, as a keeper
        makes them), which started at ``obtained_at`` on the supervisor's clock: it is
        renewed from there as if the supervisor had won it (its deadline counts from
        ``obtained_at``), reported as :class:`~mos_lease.keep.changes.BindingStarted`,
        and no campaign comes first."""
        start = _held(held, obtained_at, identity, connector_id)
        # Above the coordinator's cap every campaign call would be refused as bad input:
        # refused here instead, before anything is written.
        normalize_ttl("ttl", ttl, self.coordinator._flows.lease_ttl_cap)
        binding = _binding(self.coordinator.store, identity, connector_id, scopes, ttl, {
            "safety_margin": safety_margin, "clock_step": clock_step,
            "renew_fraction": renew_fraction, "jitter": jitter,
            "min_backoff": min_backoff, "max_backoff": max_backoff}, metadata, takeover, wait,
            once)
        with self._core.lock:
            if self._core.closing:
                raise ConfigurationError("the supervisor is closed")
            changes = self._core.schedule.add(binding, self._core.clock(), start)
        self._core.report(changes)
        self._started()

    def lease(self, identity: LeaseIdentity) -> LeaseHandle | None:
        """The lease held for ``identity`` now, or ``None`` (campaigning, its local deadline
        has passed: then the loss is recorded and reported here, or the supervisor is
        closing or closed: its leases are being released). An identity never added raises
        :class:`~mos_lease.errors.InvalidInput`."""
        with self._core.lock:
            lease, changes = self._core.schedule.lease(identity, self._core.clock())
            if self._core.closing:
                lease = None  # released by close(), if not already
        self._core.report(changes)
        return lease

    def deadline(self, identity: LeaseIdentity) -> float | None:
        """The local deadline (on the supervisor's clock) of the lease held for
        ``identity``, or ``None`` if none is held: the moment the lease counts as lost
        unless renewed before, which an ``on_expiring`` report counts down to."""
        with self._core.lock:
            return None if self._core.closing else self._core.schedule.deadline(identity)

    def stats(self) -> SupervisorStats:
        """What this supervisor did since it was created, and the bindings it holds now
        (:class:`mos_lease.stats.SupervisorStats`)."""
        counts = self._counts
        with self._core.lock:
            slots = self._core.schedule.slots.values()
            held = sum(1 for slot in slots if slot.state is not None)
            registered = len(slots)
        return SupervisorStats(counts.renewal_ticks, counts.renewed, counts.last_renewed,
                               counts.campaign_reads, counts.acquires, counts.takeovers,
                               counts.releases, counts.notices, registered, held,
                               counts.hedges)

    @property
    def bindings(self) -> list[LeaseIdentity]:
        """The identities registered, held or not."""
        with self._core.lock:
            return list(self._core.schedule.slots)

    def start(self, name: str | None = None) -> None:
        """Run in the background from now on (a thread, or a task on the running loop,
        named ``name`` if given), pausing on real waits that a notice or an ``add()`` ends
        early: for a supervisor turned by hand until now (``background=False``, its
        injected ``sleep``), as :func:`~mos_lease.hold` waits for its lease in the caller's
        thread and then keeps it in the background. Nothing if it runs already."""
        with self._core.lock:
            if self._core.closing:
                raise ConfigurationError("the supervisor is closed")
            self._background = True
            self._sleep = self._real_sleep()
            if name is not None:
                self._name = name
        self._started()

    def _real_sleep(self) -> Any:
        """The driver's own pause, which a wake-up ends early."""
        raise NotImplementedError

    def _started(self) -> None:
        """A binding was added: wake the loop (and start it, if it does not run yet)."""
        raise NotImplementedError

    def _wake_from_thread(self) -> bool:
        """End the loop's sleep from any thread (a confirming read is due); whether the
        loop could be woken."""
        raise NotImplementedError

    def _take(self, identity: LeaseIdentity) -> LeaseHandle | None:
        """Drop ``identity`` for ``remove()``: its held lease, to release. Nothing while
        the supervisor closes: ``close()`` releases every lease and reports it."""
        with self._core.lock:
            if self._core.closing:
                return None
        lease, changes = self._drop(identity)
        self._core.report(changes)
        return lease

    def _drop(self, identity: LeaseIdentity) -> tuple[LeaseHandle | None, list[Change]]:
        """Forget ``identity``: its held lease (to release) and the loss to report."""
        with self._core.lock:
            slot = self._core.schedule.slots.get(identity)
            lease, changes = self._core.schedule.remove(identity, self._core.clock(),
                                                        closing=self._core.closing)
            if slot is None:  # ended (held once) or gone: its confirming turn, if any
                slot = next((s for s in self._core.confirming
                             if s.binding.identity == identity), None)
            done = None if slot is None else self._core.confirming.pop(slot, None)
            if self._notices is not None:
                self._notices.forget(identity)
        if done is not None:
            done()
        return lease, changes

    def _to_release(self) -> list[list[LeaseHandle]]:
        """On close, once the loop has stopped: every held lease, in batches of
        :data:`BATCH` (one ``release_many`` each). They are released before any binding is
        dropped (:meth:`_closed`): dropping thousands takes a few hundred ms of CPU, which
        the members taking the bindings over would otherwise wait for; meanwhile
        ``lease()`` answers ``None`` (closing) and no turn runs."""
        if self._notices is not None:
            self._notices.close()
        with self._core.lock:
            schedule = self._core.schedule
            fleet = schedule.fleet
            held = [slot.state.lease for slot in schedule.slots.values()
                    if slot.state is not None and slot.state.loss is None]
        if fleet is not None:
            # A fleet member's own lease goes first: its release moves the others'
            # placement at once, and each then takes the bindings it gains as their
            # releases follow (a release notice of a binding preferred to a member is
            # acted on at once), instead of waiting for the whole close.
            held.sort(key=lambda lease: lease.identity != fleet.identity)
        return [held[first:first + BATCH] for first in range(0, len(held), BATCH)]

    @staticmethod
    def _released(batch: Sequence[LeaseHandle],
                  outcome: Sequence[LeaseResult] | BaseException) -> None:
        """After the ``release_many`` of ``batch`` on close (its results, or what it raised):
        a release that failed is logged (the lease then expires at its ttl)."""
        for k, lease in enumerate(batch):
            single = outcome if isinstance(outcome, BaseException) else outcome[k]
            if isinstance(single, BaseException) or not single.ok:
                log.warning("mos_lease: could not release %s on close: %r", lease.identity,
                            single if isinstance(single, BaseException) else single.reason)

    def _closed(self) -> None:
        """Every lease is released (or failed to be): every binding is dropped, each held
        one reported lost (``STOPPED``) now that its release is written, not before (a
        ``STOPPED`` loss says the lease is given back); then the change iterators end."""
        with self._core.lock:
            identities = list(self._core.schedule.slots)
        for identity in identities:
            self._core.report(self._drop(identity)[1])
        for listener in list(self._core.listeners):
            listener(_CLOSED)
