"""The two supervisors: :class:`Supervisor` runs the turns of ``flow.py`` on one thread,
:class:`AsyncSupervisor` as one asyncio task. Each only performs the calls a turn yields."""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import random as _random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any, Generic, TypeVar

from mos_lease.bounded import bounded, bounded_async
from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator
from mos_lease.errors import ConfigurationError
from mos_lease.flowdrive import Drive, outcome_of, outcome_of_async
from mos_lease.identity import LeaseIdentity, check_id, check_identity, normalize_scopes
from mos_lease.keeper import KeeperTiming, default_clock_step
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult
from mos_lease.supervisor.flow import (
    Attempt,
    Call,
    Core,
    IssueGrant,
    Release,
    Sleep,
    issue_grant,
    turn,
    turn_failed,
)
from mos_lease.supervisor.schedule import (
    Acquire,
    Binding,
    Change,
    ReadHolder,
    Renew,
    Takeover,
)

log = logging.getLogger("mos_lease.supervisor")

C = TypeVar("C", ConnectorLeaseCoordinator, AsyncConnectorLeaseCoordinator)

_CLOSED: Any = None  # what a listener is sent when the supervisor closes


def _binding(store: object, identity: LeaseIdentity, connector_id: str, scopes: object,
             ttl: float | timedelta, options: dict[str, float | None]) -> Binding:
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
    if options.get("clock_step") is None:  # the store says whether its time can step
        options["clock_step"] = default_clock_step(store)
    timing = KeeperTiming(seconds, **{k: v for k, v in options.items() if v is not None})
    return Binding(check_identity("identity", identity), check_id("connector_id", connector_id),
                   normalize_scopes("scopes", scopes), timing)


class _Supervisor(Generic[C]):
    """What both supervisors share: registering, reading, and the core."""

    _kind: type[C]

    def __init__(self, coordinator: C, *,
                 on_change: Callable[[Change], object] | None = None,
                 clock: Callable[[], float] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True) -> None:
        if not isinstance(coordinator, self._kind):
            raise ConfigurationError(f"{type(self).__name__} needs a {self._kind.__name__}, "
                                     f"not {type(coordinator).__name__}")
        if on_change is not None and not callable(on_change):
            raise ConfigurationError("on_change must be callable")
        self.coordinator: C = coordinator
        # Deadlines are kept on the coordinator's monotonic clock unless told otherwise.
        self._core = Core(clock if clock is not None else coordinator.monotonic, random,
                          on_change)
        self._background = background

    def add(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
            ttl: float | timedelta, safety_margin: float | None = None,
            clock_step: float | None = None, renew_fraction: float | None = None,
            jitter: float = 0.0, min_backoff: float | None = None,
            max_backoff: float | None = None) -> None:
        """Run ``identity`` as ``connector_id``: campaign for its lease, hold it, and
        campaign again after a loss, until :meth:`remove` or :meth:`close`. The timing
        options are :class:`~mos_lease.keeper.KeeperTiming`'s (``docs/keeper.md``), except
        that ``jitter`` defaults to 0: a process's renewals are meant to go out together,
        and ``clock_step`` to 0 over a store that cannot fail over (the in-memory store).
        A ``ttl`` too short for the default safety margin raises
        :class:`~mos_lease.errors.ConfigurationError` naming ``safety_margin`` and
        ``clock_step``."""
        binding = _binding(self.coordinator.store, identity, connector_id, scopes, ttl, {
            "safety_margin": safety_margin, "clock_step": clock_step,
            "renew_fraction": renew_fraction, "jitter": jitter,
            "min_backoff": min_backoff, "max_backoff": max_backoff})
        with self._core.lock:
            if self._core.closing:
                raise ConfigurationError("the supervisor is closed")
            self._core.schedule.add(binding, self._core.clock())
        self._started()

    def lease(self, identity: LeaseIdentity) -> LeaseHandle | None:
        """The lease held for ``identity`` now, or ``None`` (campaigning, or its local
        deadline has passed: then the loss is recorded and reported here)."""
        with self._core.lock:
            lease, changes = self._core.schedule.lease(identity, self._core.clock())
        self._core.report(changes)
        return lease

    @property
    def bindings(self) -> list[LeaseIdentity]:
        """The identities registered, held or not."""
        with self._core.lock:
            return list(self._core.schedule.slots)

    def _started(self) -> None:
        """A binding was added: wake the loop (and start it, if it does not run yet)."""
        raise NotImplementedError

    def _take(self, identity: LeaseIdentity) -> LeaseHandle | None:
        with self._core.lock:
            lease, changes = self._core.schedule.remove(identity, self._core.clock())
        self._core.report(changes)
        return lease

    def _close_all(self) -> list[LeaseHandle]:
        with self._core.lock:
            identities = list(self._core.schedule.slots)
        leases = [lease for lease in map(self._take, identities) if lease is not None]
        for listener in list(self._core.listeners):
            listener(_CLOSED)
        return leases


class Supervisor(_Supervisor[ConnectorLeaseCoordinator]):
    """Runs many bindings for a :class:`~mos_lease.ConnectorLeaseCoordinator` on one thread.

    Typical use::

        with Supervisor(coordinator, on_change=print) as supervisor:
            supervisor.add(identity, "gateway-a", scopes=["tool:run"], ttl=30)
            ...
            lease = supervisor.lease(identity)  # the handle to mint grants with, or None

    Every held lease is renewed by one ``heartbeat_many`` round trip per 1,000 leases per
    tick, each judged on its own with the keeper's deadline rule. A call runs on a
    short-lived daemon thread so that one hanging past the earliest local deadline is
    abandoned and that deadline still reported; at most two threads run at once.
    ``on_change`` is called with each :data:`~mos_lease.supervisor.Change`, from the
    supervisor thread (or from the thread whose call found it). With ``background=False``
    no thread is started and :meth:`turn` drives the supervisor by hand; ``clock``
    (default: the coordinator's ``monotonic``), ``sleep`` and ``random`` are injectable.
    """

    _kind = ConnectorLeaseCoordinator

    def __init__(self, coordinator: ConnectorLeaseCoordinator, *,
                 on_change: Callable[[Change], object] | None = None,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], object] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True) -> None:
        super().__init__(coordinator, on_change=on_change, clock=clock, random=random,
                         background=background)
        self._wakeup = threading.Event()
        self._sleep = sleep if sleep is not None else self._wakeup.wait
        self._thread: threading.Thread | None = None

    def _started(self) -> None:
        self._wakeup.set()
        if self._background and self._thread is None:
            with self._core.lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="mos-lease-supervisor")
                    self._thread.start()

    def _run(self) -> None:
        while not self._core.closing:
            self._wakeup.clear()  # before the turn reads the schedule: no add is missed
            try:
                self.turn()
            except Exception as error:
                turn_failed(self._core, error)
                self._sleep(0.1)

    def turn(self) -> None:
        """One turn: renew what is due, make the campaign calls due, or sleep."""
        drive = Drive(turn(self._core), ())
        for call in drive:
            drive.send(self._perform(call))

    def _perform(self, call: Call) -> object:
        if isinstance(call, Sleep):
            return self._sleep(min(call.seconds, threading.TIMEOUT_MAX))
        if isinstance(call, Renew):
            return bounded(lambda: self.coordinator.heartbeat_many(call.leases, ttl=call.ttl),
                           call.timeout, name="mos-lease-supervisor-renewal")
        if isinstance(call, Attempt):
            return bounded(lambda: self._campaign(call), call.timeout,
                           name="mos-lease-supervisor-campaign")
        assert isinstance(call, Release)
        try:
            return self.coordinator.release(call.lease)
        except Exception as error:
            return error

    def _campaign(self, attempt: Attempt) -> object:
        call, binding = attempt.call, attempt.call.slot.binding
        if isinstance(call, ReadHolder):
            return self.coordinator.current_holder(binding.identity)
        if isinstance(call, Acquire):
            return self.coordinator.acquire(binding.identity, binding.connector_id,
                                            scopes=binding.scopes, ttl=binding.timing.ttl)
        assert isinstance(call, Takeover)
        return self.coordinator.takeover(binding.identity, binding.connector_id,
                                         scopes=binding.scopes, ttl=binding.timing.ttl,
                                         expected_epoch=call.expected_epoch,
                                         observed=call.observed)

    def issue_grant(self, identity: LeaseIdentity, *, scopes: object, ttl: float | timedelta,
                    correlation_id: str | None = None) -> GrantResult:
        """Mint a grant for the lease held for ``identity``, or refuse locally when none is
        held; the local deadline is judged before and after the store call, as a keeper's
        ``issue_grant`` does. Store errors are raised, as the coordinator raises them."""
        drive = Drive(issue_grant(self._core, identity, scopes, ttl, correlation_id))
        for call in drive:
            drive.send(outcome_of(self._grant, call))
        return drive.result

    def _grant(self, call: IssueGrant) -> GrantResult:
        return self.coordinator.issue_grant(call.lease, scopes=call.scopes, ttl=call.ttl,
                                            correlation_id=call.correlation_id)

    def remove(self, identity: LeaseIdentity) -> LeaseResult | None:
        """Stop running ``identity`` and release its lease if held (the release result,
        or ``None``); reports the loss with cause ``STOPPED``."""
        lease = self._take(identity)
        return None if lease is None else self.coordinator.release(lease)

    def close(self, *, timeout: float | None = 10.0) -> None:
        """Stop the thread and release every held lease (each reported lost, ``STOPPED``).
        A release that fails is logged; the lease then expires at its ttl."""
        with self._core.lock:
            self._core.closing = True
        self._wakeup.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        for lease in self._close_all():
            outcome = self._perform(Release(lease))
            if isinstance(outcome, BaseException):
                log.warning(
                    "mos_lease: could not release %s on close: %r", lease.identity, outcome)

    def changes(self) -> Iterator[Change]:
        """Every change from this call on, as it happens; the iteration ends when the
        supervisor closes. Changes wait in an unbounded queue until read: keep reading."""
        box: queue.SimpleQueue[Change | None] = queue.SimpleQueue()
        with self._core.lock:
            closed = self._core.closing
            self._core.listeners.append(box.put)
        return self._read(box, closed)

    def _read(self, box: queue.SimpleQueue[Change | None], closed: bool) -> Iterator[Change]:
        try:
            while not closed:
                change = box.get()
                if change is None:
                    return
                yield change
        finally:
            with self._core.lock:
                self._core.listeners.remove(box.put)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class AsyncSupervisor(_Supervisor[AsyncConnectorLeaseCoordinator]):
    """The asyncio supervisor, for an :class:`~mos_lease.AsyncConnectorLeaseCoordinator`:
    one task on the running loop (started by the first :meth:`add`). A store call runs as a
    task of its own, waited for until the earliest local deadline and abandoned past it
    (cancelled, never trusted later). Call every method on the loop. ``changes()`` is an
    async iterator; the other options are :class:`Supervisor`'s."""

    _kind = AsyncConnectorLeaseCoordinator

    def __init__(self, coordinator: AsyncConnectorLeaseCoordinator, *,
                 on_change: Callable[[Change], object] | None = None,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[object]] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True) -> None:
        super().__init__(coordinator, on_change=on_change, clock=clock, random=random,
                         background=background)
        self._wakeup = asyncio.Event()
        self._sleep = sleep if sleep is not None else self._wait_for_wakeup
        self._task: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Future[Any]] = set()

    def _started(self) -> None:
        self._wakeup.set()
        if self._background and self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="mos-lease-supervisor")

    async def _wait_for_wakeup(self, seconds: float) -> None:
        if math.isinf(seconds):
            await self._wakeup.wait()
            return
        try:
            async with asyncio.timeout(seconds):
                await self._wakeup.wait()
        except TimeoutError:
            pass

    async def _run(self) -> None:
        while not self._core.closing:
            self._wakeup.clear()
            try:
                await self.turn()
            except Exception as error:
                turn_failed(self._core, error)
                await asyncio.sleep(0.1)

    async def turn(self) -> None:
        """One turn: renew what is due, make the campaign calls due, or sleep."""
        drive = Drive(turn(self._core), ())
        for call in drive:
            drive.send(await self._perform(call))

    async def _perform(self, call: Call) -> object:
        if isinstance(call, Sleep):
            return await self._sleep(call.seconds)
        if isinstance(call, Renew):
            return await self._bounded(
                self.coordinator.heartbeat_many(call.leases, ttl=call.ttl), call.timeout)
        if isinstance(call, Attempt):
            return await self._bounded(self._campaign(call), call.timeout)
        assert isinstance(call, Release)
        try:
            return await self.coordinator.release(call.lease)
        except Exception as error:
            return error

    async def _campaign(self, attempt: Attempt) -> object:
        call, binding = attempt.call, attempt.call.slot.binding
        if isinstance(call, ReadHolder):
            return await self.coordinator.current_holder(binding.identity)
        if isinstance(call, Acquire):
            return await self.coordinator.acquire(binding.identity, binding.connector_id,
                                                  scopes=binding.scopes,
                                                  ttl=binding.timing.ttl)
        assert isinstance(call, Takeover)
        return await self.coordinator.takeover(binding.identity, binding.connector_id,
                                               scopes=binding.scopes, ttl=binding.timing.ttl,
                                               expected_epoch=call.expected_epoch,
                                               observed=call.observed)

    async def _bounded(self, call: Awaitable[object], timeout: float) -> object:
        return await bounded_async(call, timeout, self._abandoned)

    async def issue_grant(self, identity: LeaseIdentity, *, scopes: object,
                          ttl: float | timedelta, correlation_id: str | None = None
                          ) -> GrantResult:
        """As :meth:`Supervisor.issue_grant`."""
        drive = Drive(issue_grant(self._core, identity, scopes, ttl, correlation_id))
        for call in drive:
            drive.send(await outcome_of_async(self._grant, call))
        return drive.result

    async def _grant(self, call: IssueGrant) -> GrantResult:
        return await self.coordinator.issue_grant(call.lease, scopes=call.scopes, ttl=call.ttl,
                                                  correlation_id=call.correlation_id)

    async def remove(self, identity: LeaseIdentity) -> LeaseResult | None:
        """As :meth:`Supervisor.remove`."""
        lease = self._take(identity)
        return None if lease is None else await self.coordinator.release(lease)

    async def close(self) -> None:
        """Cancel the task and release every held lease (each reported lost, ``STOPPED``)."""
        with self._core.lock:
            self._core.closing = True
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            # Waited for without awaiting it, so a cancellation of the caller is not lost
            # (the asyncio keeper's stop() explains why).
            await asyncio.wait((task,))
        for lease in self._close_all():
            outcome = await self._perform(Release(lease))
            if isinstance(outcome, BaseException):
                log.warning(
                    "mos_lease: could not release %s on close: %r", lease.identity, outcome)

    def changes(self) -> AsyncIterator[Change]:
        """As :meth:`Supervisor.changes`, for ``async for``."""
        box: asyncio.Queue[Change | None] = asyncio.Queue()
        with self._core.lock:
            closed = self._core.closing
            self._core.listeners.append(box.put_nowait)
        return self._read(box, closed)

    async def _read(self, box: asyncio.Queue[Change | None], closed: bool
                    ) -> AsyncIterator[Change]:
        try:
            while not closed:
                change = await box.get()
                if change is None:
                    return
                yield change
        finally:
            with self._core.lock:
                self._core.listeners.remove(box.put_nowait)

    async def __aenter__(self) -> AsyncSupervisor:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()
