"""The thread keeper: :class:`LeaseKeeper` runs the keeper's steps on a thread of its own
and each heartbeat on a short-lived thread, so a call hung on a half-open connection is
abandoned at the deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from mos_lease.bounded import bounded
from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.errors import MosLeaseError
from mos_lease.identity import LeaseIdentity
from mos_lease.keeper import steps
from mos_lease.keeper.base import _Keeper
from mos_lease.keeper.calls import HeartbeatCall, Sleep, Step, Steps, drive
from mos_lease.keeper.schedule import Action
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
    The timing options are :class:`KeeperTiming`'s; ``docs/keeper.md`` explains them.
    """

    _kind = ConnectorLeaseCoordinator
    lost: threading.Event
    """Set once the lease is lost (or the keeper stopped); never cleared."""

    def _setup(self, sleep: Callable[[float], object] | None) -> Callable[[], object]:
        self.lost = threading.Event()
        self._wakeup = threading.Event()
        self._sleep = sleep if sleep is not None else self._wakeup.wait
        self._thread: threading.Thread | None = None
        return self._signal

    def _signal(self) -> None:
        self.lost.set()
        self._wakeup.set()

    def _drive(self, running: Steps[Any], thrown: type[BaseException] = MosLeaseError) -> Any:
        return drive(running, self._perform, thrown)

    def _perform(self, step: Step) -> Any:
        if isinstance(step, Sleep):
            return self._sleep(step.seconds)  # stop() sets the event: the pause ends at once
        if isinstance(step, HeartbeatCall):
            # On a thread of its own: a call hung on a half-open connection is abandoned
            # at the deadline (OVERDUE) instead of holding the keeper past it.
            return bounded(lambda: step.on(self.heartbeat_coordinator), step.timeout,
                           name="mos-lease-heartbeat")
        return step.on(self.coordinator)

    # -- getting a lease -----------------------------------------------------------------

    def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                correlation_id: str | None = None,
                metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """:meth:`ConnectorLeaseCoordinator.acquire` with the keeper's ttl (and the holder
        ``metadata``, if given); on success the keeper holds the lease and starts renewing
        it. A refusal leaves the keeper unused."""
        return self._start(self._acquire(identity, connector_id, scopes, correlation_id,
                                         metadata))

    def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                 expected_epoch: int, correlation_id: str | None = None,
                 metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """:meth:`ConnectorLeaseCoordinator.takeover` at ``expected_epoch`` with the
        keeper's ttl (and the holder ``metadata``, if given); on success the keeper holds
        the lease and starts renewing it. A refusal leaves the keeper unused."""
        return self._start(self._takeover(identity, connector_id, scopes, expected_epoch,
                                          correlation_id, metadata))

    def adopt(self, lease: LeaseHandle, *, obtained_at: float) -> None:
        """Keep a lease obtained elsewhere with this keeper's ttl. ``obtained_at`` must be
        the keeper clock's reading taken *before* the call that produced ``lease``."""
        self._start(self._adopt(lease, obtained_at))

    def _start(self, starting: Steps[Any]) -> LeaseResult:
        result: LeaseResult
        result, holding = self._drive(starting, BaseException)
        if holding and self._background:
            self._thread = threading.Thread(target=self._run, daemon=True, name=self._name())
            self._thread.start()
        return result

    # -- the heartbeat loop --------------------------------------------------------------

    def step(self) -> Action:
        """Run one decision: renew, wait, or report loss. Returns what was decided."""
        action: Action = self._drive(steps.step(self._core))
        return action

    def _run(self) -> None:
        while not self._wakeup.is_set() and not self.lost.is_set():
            try:
                self.step()
            except Exception as error:
                steps.run_failed(self._core, error)

    # -- using the lease -----------------------------------------------------------------

    def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                    correlation_id: str | None = None) -> GrantResult:
        """Mint a grant for the kept lease, or refuse locally once it is lost (the deadline
        is checked before and after the store call)."""
        result: GrantResult = self._drive(steps.issue_grant(self._core, scopes, ttl,
                                                            correlation_id))
        return result

    # -- stopping ------------------------------------------------------------------------

    def stop(self, *, release: bool = True, timeout: float | None = 10.0) -> LeaseResult | None:
        """Stop renewing and, if the lease is still held and ``release``, release it.

        Returns the release result, or ``None`` if nothing was released. Marks the keeper
        lost with cause ``STOPPED`` (so ``lost`` waiters wake up) unless it already was.
        """
        self._wakeup.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        result: LeaseResult | None = self._drive(steps.stop(self._core, release))
        return result

    def __enter__(self) -> LeaseKeeper:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
