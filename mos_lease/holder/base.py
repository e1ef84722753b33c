"""What the thread and asyncio holders share: entering and leaving the block (generators of
steps, like :func:`~mos_lease.holder.waiting.waiting`, which the shells run with
:func:`~mos_lease.keeper.calls.drive` or ``drive_async``), what a step is made on, the held
lease, loss and ``on_expiring`` reports, and the handling of notices (each a request for a
coalesced, rate-bounded confirming turn: :mod:`mos_lease.notice_confirmer`)."""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any, Generic, TypeVar

import attrs

from mos_lease.clock import MonotonicClock
from mos_lease.errors import InvalidInput, MosLeaseError
from mos_lease.holder.options import HoldOptions, LeaseLost, NoticeSource
from mos_lease.holder.waiting import expiring_check, waiting
from mos_lease.identity import LeaseIdentity
from mos_lease.keeper import AsyncLeaseKeeper, LeaseKeeper, LeaseLoss, LossCause
from mos_lease.keeper.calls import CurrentHolderCall, Step
from mos_lease.notice_confirmer import Done, NoticeConfirmer, confirmer_of
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, HolderView, LeaseResult
from mos_lease.supervisor.schedule import newer, superseded

log = logging.getLogger("mos_lease.holder")  # the name docs/telemetry.md gives operators

K = TypeVar("K", LeaseKeeper, AsyncLeaseKeeper)


@attrs.frozen(slots=True)
class KeeperAdopt:
    """Hand the lease just won to the new keeper (``keeper.adopt``). Made on the keeper,
    as the coordinator calls of :mod:`mos_lease.keeper.calls` are made on the coordinator."""

    lease: LeaseHandle
    started: float

    def on(self, keeper: LeaseKeeper | AsyncLeaseKeeper) -> Any:
        return keeper.adopt(self.lease, obtained_at=self.started)


@attrs.frozen(slots=True)
class KeeperStop:
    """Stop the keeper and release the lease (``keeper.stop(release=True)``)."""

    def on(self, keeper: LeaseKeeper | AsyncLeaseKeeper) -> Any:
        return keeper.stop(release=True)


HolderStep = Step | KeeperAdopt | KeeperStop


def _confirmer_of(notices: NoticeSource | None) -> NoticeConfirmer:
    """The confirmer a source names as ``confirmer`` (``LeaseNotices`` does), else the
    process's: either way one for all the holders that share it."""
    return confirmer_of(notices)


class _HolderBase(Generic[K]):
    """State and behaviour that do not depend on threads or asyncio. ``K`` is the keeper
    class; a shell performs the steps (``_perform``) and adds what only it has."""

    _keeper: K | None

    def __init__(self, coordinator: Any, options: HoldOptions, *, sleep: Any,
                 heartbeat_coordinator: Any) -> None:
        self.coordinator = coordinator
        self.options = options
        self._heartbeat_coordinator = heartbeat_coordinator
        self._sleep = sleep
        self._notices: NoticeSource | None = options.notices
        self._confirmer = _confirmer_of(options.notices)
        self._callbacks = options.callbacks
        # The coordinator's clock unless told otherwise, for the wait and the keeper alike.
        self._clock: MonotonicClock = (coordinator.monotonic if options.clock is None
                                       else options.clock)
        self._random = options.random
        self._keeper = None
        self._loss: LeaseLoss | None = None
        self._expiring_fired_for: float | None = None

    # -- entering and leaving, as steps --------------------------------------------------

    def _entering(self, kind: type[K]) -> Generator[HolderStep, Any, LeaseHandle]:
        """Wait for the lease, then hand it to a new keeper of ``kind``; the held lease.
        Drive it with every failure thrown in, so a wait that fails or is cancelled stops
        listening for notices."""
        if self._keeper is not None:
            raise InvalidInput("holder", "a holder holds once; call hold() again")
        # Subscribed before the first read, so a change between that read and the pause
        # still ends the pause.
        self._subscribe()
        try:
            acquired = yield from waiting(self.options, self._clock, self._random,
                                          self._new_holder)
        except BaseException:
            self._unsubscribe()
            raise
        lease = acquired.result.lease
        assert lease is not None
        timing = self.options.timing
        self._keeper = kind(self.coordinator, ttl=timing.ttl, min_backoff=timing.min_backoff,
                            max_backoff=timing.max_backoff, clock_step=timing.clock_step,
                            safety_margin=timing.safety_margin,
                            on_lost=self._keeper_lost, clock=self._clock, random=self._random,
                            heartbeat_coordinator=self._heartbeat_coordinator,
                            on_event=self._callbacks.on_event)
        yield KeeperAdopt(lease, acquired.started)
        return lease

    def _leaving(self) -> Generator[HolderStep, Any, None]:
        """Stop the keeper, giving the lease back. Drive it with ordinary failures thrown
        in: a failed release is logged, never raised over the block's own exception (or its
        clean exit: the lease expires on its own at the store's time, and nobody can act on
        it meanwhile)."""
        try:
            result: LeaseResult | None = yield KeeperStop()
        except Exception:
            log.exception("mos_lease: release of %s failed", self.options.identity)
            return
        if result is not None and not result.ok:
            log.info("mos_lease: release of %s refused: %s", self.options.identity,
                     result.reason)

    def _target(self, step: HolderStep) -> Any:
        """What ``step`` is made on: the keeper for a keeper step, else the coordinator."""
        if isinstance(step, KeeperAdopt | KeeperStop):
            return self._require_keeper()
        return self.coordinator

    @staticmethod
    def _watcher_name(lease: LeaseHandle) -> str:
        # Named by identity only: a thread or task name can reach log records, a lease UUID
        # and scopes must not.
        return f"mos-lease-holder {lease.identity}"

    # -- what the body uses ----------------------------------------------------------------

    @property
    def lease(self) -> LeaseHandle:
        """The held lease's handle; raises :class:`LeaseLost` once it is lost."""
        keeper = self._require_keeper()
        self._raise_if_lost()
        lease = keeper.lease
        assert lease is not None  # not lost, so held
        return lease

    @property
    def lost(self) -> LeaseLoss | None:
        """Why the lease was lost while held (``None`` while held, and after a clean exit:
        giving the lease back is not a loss). The local deadline is checked on the spot."""
        if self._keeper is not None and self._keeper.lease is not None:
            self._keeper.enforce_deadline()  # a passed deadline is recorded (and reported) now
        return self._loss

    def _require_keeper(self) -> K:
        if self._keeper is None:
            raise InvalidInput("holder", "holds no lease: use it as a context manager")
        return self._keeper

    def _granting(self) -> K:
        """The keeper to ask for a grant; raises :class:`LeaseLost` once the lease is lost
        (refused locally: nothing reaches the store)."""
        keeper = self._require_keeper()
        self._raise_if_lost()
        return keeper

    def _granted(self, result: GrantResult) -> GrantResult:
        """A refusal that revealed the loss raises :class:`LeaseLost`; any other result is
        returned."""
        if not result.ok:
            self._raise_if_lost()
        return result

    def _raise_if_lost(self) -> None:
        keeper = self._require_keeper()
        if keeper.lease is not None:
            keeper.enforce_deadline()
        loss = keeper.loss
        if loss is not None:
            raise LeaseLost(self._loss if self._loss is not None else loss)

    # -- events --------------------------------------------------------------------------

    def _new_holder(self, connector_id: str, epoch: int) -> None:
        self._callbacks.call("on_new_holder", connector_id, epoch)

    def _keeper_lost(self, loss: LeaseLoss) -> None:
        """The keeper's ``on_lost``: runs once, on the keeper's thread or the loop."""
        if loss.cause is LossCause.STOPPED:
            return  # our own exit giving the lease back: not a loss
        self._loss = loss
        self._callbacks.call("on_lost", loss)
        self._after_loss(loss)

    def _after_loss(self, loss: LeaseLoss) -> None:
        """What a shell does on loss besides reporting it (the asyncio one may cancel)."""

    def _check_expiring(self) -> float | None:
        """Report ``on_expiring`` when due; the seconds until it is worth looking again, or
        ``None`` once there is nothing left to watch."""
        keeper = self._keeper
        deadline = None if keeper is None or keeper.lease is None else keeper.deadline
        if deadline is None:
            return None
        left, again = expiring_check(deadline, self._clock(), self.options.expiring_within)
        if left is not None and self._expiring_fired_for != deadline:
            # Once per deadline: a renewal that succeeds moves it and re-arms the report.
            self._expiring_fired_for = deadline
            self._callbacks.call("on_expiring", left)
        return again

    def _notice(self, identity: LeaseIdentity, epoch: int) -> None:
        """The hook for a push source of lease changes: ``identity``'s lease is now at
        ``epoch``. Safe to call from any thread, as often as notices come: it only asks the
        notice confirmer for a turn (:mod:`mos_lease.notice_confirmer`), which coalesces
        and rate-bounds them; in its turn a holder reads the row and reports loss if its
        epoch is superseded, a waiter looks again at once. A notice is only a hint: it never
        grants anything, and anyone who can log in may send one."""
        if identity != self.options.identity:
            return
        if newer(self._held_lease(), epoch):  # else nothing newer than what is held
            self._confirmer.notice(identity)

    def _held_lease(self) -> LeaseHandle | None:
        keeper = self._keeper
        return None if keeper is None else keeper.lease

    def _confirmation(self, held: LeaseHandle) -> Generator[HolderStep, Any, None]:
        """A confirming turn while holding, as steps: read the row and report loss if it
        shows ``held`` superseded. A read that fails confirms nothing: the keeper's next
        renewal decides."""
        try:
            view: HolderView | None = yield CurrentHolderCall(self.options.identity)
        except MosLeaseError:
            return
        self._lose_to(held, view)

    def _lose_to(self, held: LeaseHandle, view: HolderView | None) -> None:
        """Report loss if the store's ``view`` shows ``held`` superseded (the supervisor's
        rule, :func:`~mos_lease.supervisor.schedule.superseded`)."""
        keeper = self._keeper
        loss = None if keeper is None else superseded(held, view, self._clock())
        if keeper is not None and loss is not None:
            keeper.mark_lost(loss)

    def _confirm(self, done: Done) -> None:
        """This holder's job in a confirming turn (called on the confirmer's thread): read
        and report a superseded epoch while holding, else wake the waiter; ``done()`` once
        that is over."""
        raise NotImplementedError

    def _wake(self) -> None:
        raise NotImplementedError

    def _on_notice(self, epoch: int, kind: str) -> None:
        """The callback given to the notice source; runs on its thread (see ``_notice``)."""
        self._notice(self.options.identity, epoch)

    def _subscribe(self) -> None:
        self._confirmer.register(self.options.identity, self._confirm)
        if self._notices is not None:
            self._notices.subscribe(self.options.identity, self._on_notice)

    def _unsubscribe(self) -> None:
        if self._notices is not None:
            self._notices.unsubscribe(self.options.identity, self._on_notice)
        self._confirmer.unregister(self.options.identity, self._confirm)
