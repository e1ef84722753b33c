"""The thread keeper: :class:`LeaseKeeper` keeps one lease on the supervisor engine's thread
(:class:`~mos_lease.supervisor.Supervisor`), each heartbeat on a short-lived thread of its
own, so a call hung on a half-open connection is abandoned at the deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import timedelta

from mos_lease import held_grant
from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.errors import InvalidInput
from mos_lease.flowdrive import Drive, outcome_of
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.keeper import _adopted, _Keeper
from mos_lease.keep.keeper_calls import AcquireCall, IssueGrantCall, TakeoverCall
from mos_lease.keep.runner import Supervisor
from mos_lease.keep.timing import Action, ReportLoss
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult


class LeaseKeeper(_Keeper[ConnectorLeaseCoordinator, Callable[[float], object]]):
    """Holds one lease for a :class:`ConnectorLeaseCoordinator`, renewing it on a thread.

    Typical use::

        keeper = LeaseKeeper(coordinator, ttl=30, on_lost=stop_working)
        result = keeper.acquire(identity, "claude-1", scopes=["tool:run"])
        if result.ok:
            grant = keeper.issue_grant(scopes=["tool:run"], ttl=10)
            ...
        keeper.stop()  # stops renewing and releases the lease

    A keeper keeps one lease: once lost or stopped it stays so; make a new one to try again.
    It is the supervisor engine running that one binding, held once: the same schedule,
    deadline and loss rule as every binding of a :class:`~mos_lease.supervisor.Supervisor`.
    ``clock`` is the monotonic clock the local deadline is kept on: by default the
    coordinator's (:attr:`~mos_lease.ConnectorLeaseCoordinator.monotonic`), so one clock
    serves the coordinator and its keepers. ``sleep`` and ``random`` are injectable for
    tests; with ``background=False`` no thread is started and :meth:`step` drives the
    keeper by hand.
    Each heartbeat runs on its own short-lived daemon thread, so a store call that hangs
    (a half-open TCP connection) cannot delay the loss past the deadline; such a call is
    abandoned, and the coordinator's store must tolerate a call still running on it.
    ``on_lost`` is called once, from whichever thread noticed the loss. ``on_event``
    receives :class:`~mos_lease.events.Renewed`, :class:`~mos_lease.events.RenewalRetry`
    and :class:`~mos_lease.events.Lost` events (the coordinator has a hook of its own).

    ``heartbeat_coordinator`` (default: ``coordinator``) is the coordinator heartbeats go
    through. Give it one on a store (a connection) of its own, with the same policy, so a
    heartbeat stuck on its connection never holds up the grants issued and validated
    through ``coordinator``; acquire, takeover, grants and release use ``coordinator``.
    The timing options are :class:`~mos_lease.keep.timing.KeeperTiming`'s;
    ``docs/keeping.md`` explains them.
    """

    _kind = ConnectorLeaseCoordinator
    _engine_kind = Supervisor
    _engine: Supervisor
    lost: threading.Event
    """Set once the lease is lost (or the keeper stopped); never cleared."""

    def _setup(self) -> None:
        self.lost = threading.Event()

    def _signal(self) -> None:
        self.lost.set()

    @property
    def _thread(self) -> threading.Thread | None:
        return self._engine._worker._thread

    # -- getting a lease -----------------------------------------------------------------

    def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                correlation_id: str | None = None,
                metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """:meth:`ConnectorLeaseCoordinator.acquire` with the keeper's ttl (and the holder
        ``metadata``, if given); on success the keeper holds the lease and starts renewing
        it. A refusal leaves the keeper unused."""
        return self._start(self._acquire_call(identity, connector_id, scopes, correlation_id,
                                              metadata))

    def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                 expected_epoch: int, correlation_id: str | None = None,
                 metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """:meth:`ConnectorLeaseCoordinator.takeover` at ``expected_epoch`` with the
        keeper's ttl (and the holder ``metadata``, if given); on success the keeper holds
        the lease and starts renewing it. A refusal leaves the keeper unused."""
        return self._start(self._takeover_call(identity, connector_id, scopes, expected_epoch,
                                               correlation_id, metadata))

    def adopt(self, lease: LeaseHandle, *, obtained_at: float) -> None:
        """Keep a lease obtained elsewhere with this keeper's ttl. ``obtained_at`` must be
        the keeper clock's reading taken *before* the call that produced ``lease``."""
        self._start(_adopted(lease), obtained_at)

    def _start(self, call: AcquireCall | TakeoverCall | LeaseResult,
               obtained_at: float | None = None) -> LeaseResult:
        started = self._claim_start()
        result: LeaseResult | None = None
        try:
            result = call if isinstance(call, LeaseResult) else call.on(self.coordinator)
        finally:
            self._started(result, started if obtained_at is None else obtained_at)
        assert result is not None
        return result

    # -- the heartbeat loop --------------------------------------------------------------

    def step(self) -> Action:
        """Run one decision: renew, wait, or report loss. Returns what was decided."""
        action = self._action()
        if isinstance(action, ReportLoss):
            self.enforce_deadline()
        else:
            self._engine.turn()  # renews if due, else sleeps until the renewal
        return action

    # -- using the lease -----------------------------------------------------------------

    def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                    correlation_id: str | None = None) -> GrantResult:
        """Mint a grant for the kept lease, or refuse locally once it is lost (the deadline
        is checked before and after the store call)."""
        self._require()
        drive = Drive(held_grant.issue_grant(self, self._clock, scopes, ttl, correlation_id))
        for call in drive:
            drive.send(outcome_of(self._grant, call))
        return drive.result

    def _grant(self, call: IssueGrantCall) -> GrantResult:
        result: GrantResult = call.on(self.coordinator)
        return result

    # -- stopping ------------------------------------------------------------------------

    def stop(self, *, release: bool = True, timeout: float | None = 10.0) -> LeaseResult | None:
        """Stop renewing and, if the lease is still held and ``release``, release it.

        Returns the release result, or ``None`` if nothing was released. Marks the keeper
        lost with cause ``STOPPED`` (so ``lost`` waiters wake up) unless it already was.
        """
        identity = self._stopping()
        if identity is None:
            return None  # nothing held yet: the keeper may still start
        try:
            result = self._engine.remove(identity, release=release)
        except InvalidInput:
            result = None  # stopped already
        self._engine.close(timeout=timeout)
        return result

    def __enter__(self) -> LeaseKeeper:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
