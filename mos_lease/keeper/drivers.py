"""The two keepers: :class:`LeaseKeeper` runs the steps of ``steps.py`` on a thread,
:class:`AsyncLeaseKeeper` as an asyncio task. Each only performs the steps: a coordinator
call is made by the call itself (``call.on(coordinator)``, :mod:`mos_lease.keeper.calls`);
what a driver adds is how it waits (a pause that a stop ends early, a heartbeat abandoned at
the deadline), which is where threads and asyncio differ.
"""

from __future__ import annotations

import asyncio
import logging
import random as _random
import threading
import warnings
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, Generic, TypeVar

from mos_lease.bounded import bounded
from mos_lease.clock import MonotonicClock
from mos_lease.coordinator import (
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
)
from mos_lease.errors import ConfigurationError, InvalidInput, MosLeaseError
from mos_lease.events import EventHook
from mos_lease.identity import LeaseIdentity
from mos_lease.keeper import steps
from mos_lease.keeper.calls import (
    AcquireCall,
    HeartbeatCall,
    Sleep,
    Step,
    Steps,
    TakeoverCall,
    drive,
    drive_async,
)
from mos_lease.keeper.schedule import Action, KeeperTiming, LeaseLoss
from mos_lease.keeper.steps import OVERDUE, KeeperCore
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult
from mos_lease.vocabulary import Outcome

log = logging.getLogger("mos_lease.keeper")

C = TypeVar("C", ConnectorLeaseCoordinator, AsyncConnectorLeaseCoordinator)
S = TypeVar("S")


def _renewer(coordinator: C, heartbeat_coordinator: C | None, kind: type[C]) -> C:
    """The coordinator the keeper heartbeats through: by default its own; given another
    (on a store of its own), a heartbeat stuck on its connection cannot hold up the grant
    issues and validations going through ``coordinator``'s store."""
    if heartbeat_coordinator is None:
        return coordinator
    if not isinstance(heartbeat_coordinator, kind):
        raise ConfigurationError(f"heartbeat_coordinator must be a {kind.__name__}, not "
                                 f"{type(heartbeat_coordinator).__name__}")
    return heartbeat_coordinator


def _timing(ttl: float | timedelta, **options: float | None) -> KeeperTiming:
    # An option left at None takes KeeperTiming's default.
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
    return KeeperTiming(seconds, **{k: v for k, v in options.items() if v is not None})


def _adopted(lease: object) -> LeaseResult:
    if not isinstance(lease, LeaseHandle):
        raise InvalidInput("lease", f"must be a LeaseHandle, not {type(lease).__name__}")
    return LeaseResult(Outcome.ACQUIRED, None, "adopted", lease=lease)


class _Keeper(Generic[C, S]):
    """What both keepers share: construction and the read-only view of the core. ``C`` is
    the coordinator class, ``S`` the type of ``sleep``; a shell adds ``_setup``, which makes
    its own parts, and ``_perform``, which performs one step."""

    _kind: type[C]  # the class heartbeat_coordinator must be

    def __init__(self, coordinator: C, *, ttl: float | timedelta,
                 renew_fraction: float | None = None, jitter: float | None = None,
                 safety_margin: float | None = None, min_backoff: float | None = None,
                 max_backoff: float | None = None, clock_step: float | None = None,
                 on_lost: Callable[[LeaseLoss], object] | None = None,
                 clock: MonotonicClock | None = None,
                 sleep: S | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True,
                 heartbeat_coordinator: C | None = None,
                 on_event: EventHook | None = None) -> None:
        signal = self._setup(sleep)
        self.coordinator: C = coordinator
        self.heartbeat_coordinator: C = _renewer(coordinator, heartbeat_coordinator,
                                                 self._kind)
        timing = _timing(ttl, renew_fraction=renew_fraction, jitter=jitter,
                         safety_margin=safety_margin, min_backoff=min_backoff,
                         max_backoff=max_backoff, clock_step=clock_step)
        # The coordinator's clock unless told otherwise: deadlines and the coordinator's
        # in-flight times are then measured on one clock (CLOCK_BOOTTIME by default, so a
        # process resumed from suspend finds its deadline passed).
        self._core = KeeperCore(timing, coordinator.monotonic if clock is None else clock,
                                random, on_lost, on_event, signal)
        self.ttl = timing.ttl
        self._background = background

    def _setup(self, sleep: S | None) -> Callable[[], object]:
        """Make the shell's own parts (its ``lost`` event first); return the loss signal."""
        raise NotImplementedError

    @property
    def timing(self) -> KeeperTiming:
        return self._core.timing

    @property
    def lease(self) -> LeaseHandle | None:
        """The current handle, or ``None`` before a lease is held and after it is lost."""
        return self._core.lease

    @property
    def loss(self) -> LeaseLoss | None:
        return self._core.loss

    @property
    def deadline(self) -> float | None:
        """The local deadline on the keeper's clock (``None`` before a lease is held)."""
        return self._core.deadline

    def enforce_deadline(self) -> LeaseLoss | None:
        """Record the loss if the local deadline has passed by now (reported like any
        loss, once); return the loss, if the lease is lost."""
        return self._core.enforce_deadline()

    def check(self) -> LeaseLoss | None:
        """Deprecated name of :meth:`enforce_deadline` (it records a loss, so it is not a
        mere check)."""
        warnings.warn("LeaseKeeper.check() is deprecated: use enforce_deadline(), which "
                      "records a passed deadline as loss", DeprecationWarning, stacklevel=2)
        return self.enforce_deadline()

    def mark_lost(self, loss: LeaseLoss) -> None:
        """Record a loss learned elsewhere (say, news of a newer epoch) without waiting for
        the next heartbeat to find it; reported like any other loss, once. (On the
        asyncio keeper, call it on the loop.)"""
        self._core.lose(loss)

    def _name(self) -> str:
        # Named by identity only: a thread or task name reaches log records, and a
        # handle's repr carries the lease UUID and the scopes.
        return f"mos-lease-keeper {self._core.require_state().lease.identity}"

    # -- which steps the public methods run ---------------------------------------------

    def _acquire(self, identity: LeaseIdentity, connector_id: str, scopes: object,
                 correlation_id: str | None) -> Steps[Any]:
        return steps.start(self._core, AcquireCall(identity, connector_id, scopes, self.ttl,
                                                   correlation_id))

    def _takeover(self, identity: LeaseIdentity, connector_id: str, scopes: object,
                  expected_epoch: int, correlation_id: str | None) -> Steps[Any]:
        return steps.start(self._core, TakeoverCall(identity, connector_id, scopes, self.ttl,
                                                    expected_epoch, correlation_id))

    def _adopt(self, lease: LeaseHandle, obtained_at: float) -> Steps[Any]:
        return steps.start(self._core, _adopted(lease), obtained_at)


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
    tests; with
    ``background=False`` no thread is started and :meth:`step` drives the keeper by hand.
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
                correlation_id: str | None = None) -> LeaseResult:
        """:meth:`ConnectorLeaseCoordinator.acquire` with the keeper's ttl; on success the
        keeper holds the lease and starts renewing it. A refusal leaves the keeper unused."""
        return self._start(self._acquire(identity, connector_id, scopes, correlation_id))

    def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                 expected_epoch: int, correlation_id: str | None = None) -> LeaseResult:
        """:meth:`ConnectorLeaseCoordinator.takeover` at ``expected_epoch`` with the
        keeper's ttl; on success the keeper holds the lease and starts renewing it. A
        refusal leaves the keeper unused."""
        return self._start(self._takeover(identity, connector_id, scopes, expected_epoch,
                                          correlation_id))

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


class AsyncLeaseKeeper(_Keeper[AsyncConnectorLeaseCoordinator,
                               Callable[[float], Awaitable[object]]]):
    """The asyncio keeper, for an :class:`AsyncConnectorLeaseCoordinator`.

    Renewal runs as a task on the running loop. ``lost`` is an :class:`asyncio.Event`
    (``await keeper.lost.wait()``); ``on_lost`` is called once, on the loop. Loss is
    reported at the deadline even if a heartbeat is still running then: that heartbeat is
    cancelled and abandoned without waiting for it to end (a driver may take long to give
    up a cancelled call), and nothing it returns later can change the reported loss.
    The options are :class:`LeaseKeeper`'s.
    """

    _kind = AsyncConnectorLeaseCoordinator
    lost: asyncio.Event
    """Set once the lease is lost (or the keeper stopped); never cleared."""

    def _setup(self, sleep: Callable[[float], Awaitable[object]] | None
               ) -> Callable[[], object]:
        self.lost = asyncio.Event()
        self._sleep = sleep if sleep is not None else asyncio.sleep
        self._task: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Future[LeaseResult]] = set()
        return self.lost.set

    async def _drive(self, running: Steps[Any],
                     thrown: type[BaseException] = MosLeaseError) -> Any:
        return await drive_async(running, self._perform, thrown)

    async def _perform(self, step: Step) -> Any:
        if isinstance(step, Sleep):
            return await self._sleep(step.seconds)  # stop() cancels the task: it ends at once
        if isinstance(step, HeartbeatCall):
            return await self._bounded_heartbeat(step)
        return await step.on(self.coordinator)

    async def _bounded_heartbeat(self, call: HeartbeatCall) -> object:
        # The heartbeat runs as a task of its own and is waited for, not awaited under a
        # timeout: cancelling a call only ends it once the call lets go, and a driver may
        # hold on to a cancelled call for as long as it waits for the server (psycopg sends
        # a cancel request and then waits for the reply).
        running = asyncio.ensure_future(call.on(self.heartbeat_coordinator))
        try:
            done, _ = await asyncio.wait((running,), timeout=max(call.timeout, 0.0))
        except asyncio.CancelledError:
            self._abandon(running)  # the keeper is stopping: the call is not waited for
            raise
        if not done:
            self._abandon(running)
            return OVERDUE
        try:
            return running.result()
        except Exception as error:
            return error

    def _abandon(self, call: asyncio.Future[LeaseResult]) -> None:
        """Cancel a heartbeat left running at the deadline and let it end on its own.

        Its result is never looked at, so it cannot bring a lost lease back; it is kept
        referenced until it ends (a task nobody references may be collected mid-run), and
        its outcome is retrieved so asyncio does not log it as never retrieved.
        """
        self._abandoned.add(call)
        call.add_done_callback(self._forget_abandoned)
        call.cancel()

    def _forget_abandoned(self, call: asyncio.Future[LeaseResult]) -> None:
        self._abandoned.discard(call)
        if not call.cancelled() and call.exception() is not None:
            log.info("mos_lease: abandoned heartbeat ended with %r", call.exception())

    async def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                      correlation_id: str | None = None) -> LeaseResult:
        """As :meth:`LeaseKeeper.acquire`: acquire with the keeper's ttl, and on success
        hold the lease and start the renewing task."""
        return await self._start(self._acquire(identity, connector_id, scopes, correlation_id))

    async def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                       expected_epoch: int, correlation_id: str | None = None) -> LeaseResult:
        """As :meth:`LeaseKeeper.takeover`: take over at ``expected_epoch`` with the
        keeper's ttl, and on success hold the lease and start the renewing task."""
        return await self._start(self._takeover(identity, connector_id, scopes,
                                                expected_epoch, correlation_id))

    async def adopt(self, lease: LeaseHandle, *, obtained_at: float) -> None:
        """As :meth:`LeaseKeeper.adopt`: keep a lease obtained elsewhere; ``obtained_at`` is
        the keeper clock's reading taken before the call that produced ``lease``."""
        await self._start(self._adopt(lease, obtained_at))

    async def _start(self, starting: Steps[Any]) -> LeaseResult:
        result: LeaseResult
        result, holding = await self._drive(starting, BaseException)
        if holding and self._background:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name())
        return result

    async def step(self) -> Action:
        """Run one decision: renew, wait, or report loss. Returns what was decided."""
        action: Action = await self._drive(steps.step(self._core))
        return action

    async def _run(self) -> None:
        while not self.lost.is_set():
            try:
                await self.step()
            except Exception as error:
                steps.run_failed(self._core, error)

    async def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                          correlation_id: str | None = None) -> GrantResult:
        """Mint a grant for the kept lease, or refuse locally once it is lost (the deadline
        is checked before and after the store call)."""
        result: GrantResult = await self._drive(steps.issue_grant(self._core, scopes, ttl,
                                                                  correlation_id))
        return result

    async def stop(self, *, release: bool = True) -> LeaseResult | None:
        """Stop renewing (cancelling the renewing task) and, if the lease is still held and
        ``release``, release it. Returns the release result, or ``None`` if nothing was
        released; marks the keeper lost with cause ``STOPPED`` unless it already was."""
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            # Waited for without awaiting it: ``await task`` raises the task's own
            # CancelledError, and suppressing that would drop a cancellation of the caller
            # arriving meanwhile. asyncio.wait raises only the caller's.
            await asyncio.wait((task,))
            error = None if task.cancelled() else task.exception()
            if error is not None:
                raise error  # as ``await task`` would
        result: LeaseResult | None = await self._drive(steps.stop(self._core, release))
        return result

    async def __aenter__(self) -> AsyncLeaseKeeper:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()
