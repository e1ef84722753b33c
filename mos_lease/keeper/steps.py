"""The keeper's steps: start, one heartbeat step, grant issue and stop, written once.

Each is a generator of steps (:mod:`mos_lease.keeper.calls`): it yields the coordinator
calls it needs (:class:`~mos_lease.keeper.calls.AcquireCall`, ``TakeoverCall``,
``HeartbeatCall``, ``IssueGrantCall``, ``ReleaseCall``) and :class:`~mos_lease.sleep.Sleep`,
and is resumed with their outcomes. The thread keeper (``thread_keeper.py``) and the
asyncio keeper (``asyncio_keeper.py``) run them and only perform those steps, so the two
cannot disagree: every decision (the schedule of ``schedule.py``, the deadline checks
around a grant, loss reporting) is made here, once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from mos_lease import events, held_grant
from mos_lease.bounded import OVERDUE as _OVERDUE
from mos_lease.errors import InvalidInput
from mos_lease.events import Emitter, EventHook, emitter
from mos_lease.keeper.calls import (
    AcquireCall,
    HeartbeatCall,
    ReleaseCall,
    Sleep,
    Steps,
    TakeoverCall,
)
from mos_lease.keeper.schedule import (
    Action,
    HeartbeatDue,
    KeeperState,
    KeeperTiming,
    LeaseLoss,
    LossCause,
    ReportLoss,
    Wait,
    abandoned,
    after_renewal,
    held,
    lose,
    next_action,
)
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult
from mos_lease.vocabulary import Reason

log = logging.getLogger("mos_lease.keeper")

# The answer to a :class:`HeartbeatCall` that did not return before its timeout.
OVERDUE: Any = _OVERDUE


class KeeperCore:
    """The state of one keeper, its timing, and loss reporting.

    Every change goes through :meth:`update` under a lock, so a thread keeper's heartbeat
    thread and the threads that use the lease see one history (the asyncio keeper runs
    everything on its loop and never contends for the lock). ``signal`` is told of a loss
    under the lock, so whoever sees the new state also sees the signal; the report and
    ``on_lost`` run after the lock is released, so they may call back into the keeper.
    """

    def __init__(self, timing: KeeperTiming, clock: Callable[[], float],
                 draw: Callable[[], float], on_lost: Callable[[LeaseLoss], object] | None,
                 on_event: EventHook | None, signal: Callable[[], object]) -> None:
        self.timing = timing
        self.clock = clock
        self.draw = draw
        self.on_lost = on_lost
        self.emit: Emitter | None = emitter(on_event)
        self.signal = signal
        self.lock = threading.RLock()
        self.state: KeeperState | None = None
        self.began = False
        self.beginning = False

    # -- reading -------------------------------------------------------------------------

    def require_state(self) -> KeeperState:
        with self.lock:
            if self.state is None:
                raise InvalidInput("keeper", "holds no lease: acquire, take over or adopt first")
            return self.state

    @property
    def lease(self) -> LeaseHandle | None:
        with self.lock:
            state = self.state
            return None if state is None or state.loss is not None else state.lease

    @property
    def loss(self) -> LeaseLoss | None:
        with self.lock:
            return None if self.state is None else self.state.loss

    @property
    def deadline(self) -> float | None:
        with self.lock:
            return None if self.state is None else self.state.deadline

    # -- changing ------------------------------------------------------------------------

    def claim_start(self) -> None:
        """Before an acquire, takeover or adoption: a keeper keeps one lease, once."""
        with self.lock:
            if self.began:
                raise InvalidInput("keeper", "a keeper keeps one lease; make a new keeper")
            if self.beginning:
                raise InvalidInput("keeper", "another acquire or takeover is in progress")
            self.beginning = True

    def started(self, result: LeaseResult | None, started: float) -> bool:
        """After the start call (``None`` if it raised): whether the keeper now holds a lease."""
        with self.lock:
            self.beginning = False
            if result is not None and result.ok and result.lease is not None:
                self.state = held(self.timing, result.lease, started, self.draw())
                self.began = True
            return self.began

    def update(self, change: Callable[[KeeperState], KeeperState]) -> KeeperState:
        """Apply ``change`` to the current state atomically; report a new loss exactly once."""
        with self.lock:
            old = self.require_state()
            new = change(old)
            self.state = new
            newly_lost = new.loss is not None and old.loss is None
            if newly_lost:
                self.signal()
        if newly_lost:
            assert new.loss is not None
            self.report(new.loss)
        return new

    def lose(self, loss: LeaseLoss) -> LeaseLoss:
        """Record ``loss`` unless one is recorded already (loss is final); the loss in force."""
        recorded = self.update(lambda current: lose(current, loss)).loss
        assert recorded is not None
        return recorded

    def enforce_deadline(self) -> LeaseLoss | None:
        """Record the loss if the deadline has passed by now; the loss, if there is one."""
        now = self.clock()

        def judge(state: KeeperState) -> KeeperState:
            action = next_action(state, now)
            return lose(state, action.loss) if isinstance(action, ReportLoss) else state

        return self.update(judge).loss

    # -- reporting -----------------------------------------------------------------------

    def renewed(self, new: KeeperState, finished: float, duration: float,
                outcome: LeaseResult | BaseException) -> None:
        """Report a heartbeat that neither lost the lease nor failed for good: a success
        (DEBUG) or a transient failure to be retried (WARNING, with its cause)."""
        if new.loss is not None:
            return  # reported by ``report``
        lease = new.lease
        if isinstance(outcome, LeaseResult):
            log.debug("mos_lease: renewed %s connector=%s epoch=%d in %.3f s", lease.identity,
                      lease.connector_id, lease.epoch, duration)
            if self.emit is not None:
                self.emit(events.renewal(lease, duration))
            return
        delay = max(0.0, new.renew_at - finished)
        log.warning("mos_lease: renewal of %s connector=%s epoch=%d failed (attempt %d): "
                    "%s; retrying in %.3f s, %.3f s before the local deadline",
                    lease.identity, lease.connector_id, lease.epoch, new.failures,
                    new.last_error, delay, new.deadline - finished)
        if self.emit is not None:
            self.emit(events.renewal(lease, duration, type(outcome).__name__, new.failures,
                                     delay))

    def report(self, loss: LeaseLoss) -> None:
        level = logging.INFO if loss.cause is LossCause.STOPPED else logging.WARNING
        state = self.state
        log.log(level, "mos_lease: lease %s lost: %s (%s)%s",
                None if state is None else state.lease.identity, loss.cause, loss.reason,
                f" last error: {loss.error}" if loss.error else "")
        if self.emit is not None and state is not None:
            self.emit(events.loss(state.lease, str(loss.cause), loss.reason))
        if self.on_lost is not None:
            try:
                self.on_lost(loss)
            except Exception:
                # The loss is already recorded and signalled; a failing callback must not
                # hide it or kill the keeper.
                log.exception("mos_lease: on_lost callback failed")


# --- the steps ------------------------------------------------------------------------------


def start(core: KeeperCore, begin: AcquireCall | TakeoverCall | LeaseResult,
          started: float | None = None) -> Steps[tuple[LeaseResult | None, bool]]:
    """Get the lease the keeper keeps: by the call ``begin``, or adopt ``begin``, a result
    in hand obtained at ``started``. Returns ``(result, holding)``; when ``holding``, the
    driver starts renewing. Drive it with every failure thrown in, so a failed or
    cancelled call still ends the start (and a later one may try again)."""
    core.claim_start()
    result = None
    started = core.clock() if started is None else started
    try:
        result = begin if isinstance(begin, LeaseResult) else (yield begin)
    finally:
        holding = core.started(result, started)
    return result, holding


def step(core: KeeperCore) -> Steps[Action]:
    """One decision of the heartbeat schedule: renew, wait, or report loss."""
    action: Action = next_action(core.require_state(), core.clock())
    if isinstance(action, ReportLoss):
        core.lose(action.loss)
        return action
    if isinstance(action, Wait):
        yield Sleep(max(0.0, action.until - core.clock()))
        return action
    assert isinstance(action, HeartbeatDue)
    started = core.clock()
    outcome = yield HeartbeatCall(core.require_state().lease, core.timing.ttl,
                                  action.deadline - started)
    finished = core.clock()
    draw = core.draw()
    if outcome is OVERDUE:  # abandoned at this lease's own deadline: lost
        core.update(lambda current: abandoned(current, core.timing, started, finished,
                                              action.deadline, draw))
        return action
    new = core.update(lambda current: after_renewal(current, core.timing, started, finished,
                                                    outcome, draw))
    core.renewed(new, finished, finished - started, outcome)
    return action


def run_failed(core: KeeperCore, error: Exception) -> None:
    """``step`` turns store errors into state; anything else is a bug, and a keeper that
    cannot run must not leave its lease looking healthy."""
    core.lose(LeaseLoss(LossCause.ERROR, Reason.LEASE_EXPIRED, core.clock(), repr(error)))


def issue_grant(core: KeeperCore, scopes: object, ttl: float | timedelta,
                correlation_id: str | None) -> Steps[GrantResult]:
    """Mint a grant for the kept lease, or refuse locally once it is lost: the one rule of
    :mod:`mos_lease.held_grant` (the deadline checked before and after the store call)."""
    return held_grant.issue_grant(_Granting(core), core.clock, scopes, ttl, correlation_id)


class _Granting:
    """The keeper as :class:`~mos_lease.held_grant.GrantSubject` sees it."""

    __slots__ = ("core",)

    def __init__(self, core: KeeperCore) -> None:
        self.core = core

    def held_now(self) -> LeaseHandle | None:
        if self.core.enforce_deadline() is not None:
            return None
        return self.core.require_state().lease

    def revealed(self, lease: LeaseHandle, loss: LeaseLoss) -> None:
        self.core.lose(loss)

    def last_loss(self) -> LeaseLoss | None:
        return self.core.loss


def stop(core: KeeperCore, release: bool) -> Steps[LeaseResult | None]:
    """Mark the keeper stopped (unless already lost) and release a lease still held, if
    asked. The driver has already stopped its heartbeat loop."""
    with core.lock:
        state = core.state
        if state is None:
            return None
        held_lease = state.lease if state.loss is None else None
    core.lose(LeaseLoss(LossCause.STOPPED, Reason.LEASE_RELEASED, core.clock()))
    if held_lease is None or not release:
        return None
    result: LeaseResult = yield ReleaseCall(held_lease)
    return result
