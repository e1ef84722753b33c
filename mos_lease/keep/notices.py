"""One notice listener for the whole supervisor: every lease notice of the source reaches
one callback, and a notice for a registered binding becomes a read that the supervisor's own
turn makes.

A notice is a hint, never believed (anyone who can log in may send one by the thousand).
For a binding waiting for a lease held elsewhere it moves the binding's next read of the
holder into the next turn's batched read, if that read is ``max_backoff`` old
(:meth:`~mos_lease.keep.schedule.Schedule.look`); a notice that comes sooner asks
for one confirming turn shared by all the waiting bindings of the supervisor, which reads
every binding noticed since the last such turn in the next turn's batched read
(:meth:`~mos_lease.keep.schedule.Schedule.look_now`): a peer releasing thousands of
leases at shutdown is read in a few round trips and a few turns, not held back as a flood,
and a forged flood costs a bounded number of such turns. For a held binding, all it may
cause is a *confirming turn* of the process's
:class:`~mos_lease.notice_confirmer.NoticeConfirmer` (the source's ``confirmer``, else the
process's one), the same bound the holders of :func:`~mos_lease.hold` share: coalesced per
identity (at most one turn in flight), ``burst + rate * T`` turns in any ``T`` seconds::

    source --notice(identity, epoch)--> _on_notice      (the source's thread: a look-up)
        waiting, last read max_backoff ago?  --> Schedule.look: read in the next turn
        waiting, read since?                 --> confirmer.notice(the looks' one key)
        held, and newer than the lease held?  --> confirmer.notice(identity)
    confirmer --job(done)--> _confirm                   (the confirmer's thread: no I/O)
        mark the slot (Schedule.notice), keep done, wake the supervisor
    supervisor turn --Confirm--> current_holder          (the supervisor's thread or task)
        Schedule.confirmed judges the view; then done(): the identity's turn is over

The read is made by the supervisor's turn, after the renewals due and never past the
earliest local deadline, so a flood of notices neither ends a holding nor holds up a
renewal. A notice for an identity the supervisor does not run costs one dictionary look-up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

from mos_lease.errors import ConfigurationError
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.turn import Core
from mos_lease.notice_confirmer import Done, Job, NoticeConfirmer, confirmer_of
from mos_lease.stats import SupervisorCounts

AnyNoticeCallback = Callable[[LeaseIdentity, int, str], object]
"""``callback(identity, epoch, kind)``: ``identity``'s lease is now at ``epoch`` (``kind``:
``"takeover"`` or ``"release"``), or so a notice says."""


class NoticeFeed(Protocol):
    """A push source of every lease change, for one subscriber of many identities:
    ``mos_lease_pg.notices.LeaseNotices`` is one. ``callback(identity, epoch, kind)`` is
    called from any thread, for every notice (forged ones too). A ``confirmer`` attribute, if
    it has one, names the :class:`~mos_lease.notice_confirmer.NoticeConfirmer` to bound the
    confirming reads with; else the process's is used."""

    def subscribe_all(self, callback: AnyNoticeCallback) -> None: ...

    def unsubscribe_all(self, callback: AnyNoticeCallback) -> None: ...


def check_feed(value: object) -> NoticeFeed | None:
    """``value`` as a :class:`NoticeFeed`, or ``None``; anything else is refused."""
    if value is None:
        return None
    if not (callable(getattr(value, "subscribe_all", None))
            and callable(getattr(value, "unsubscribe_all", None))):
        raise ConfigurationError("notices must have subscribe_all() and unsubscribe_all() "
                                 f"(a LeaseNotices) or be None, not {type(value).__name__}")
    return value  # type: ignore[return-value]


class SupervisorNotices:
    """The supervisor's one subscription to ``feed`` (see the module's docstring).
    ``wake()`` ends the supervisor's sleep from any thread and says whether it could (an
    asyncio supervisor whose loop has closed cannot)."""

    def __init__(self, feed: NoticeFeed, core: Core, wake: Callable[[], bool],
                 counts: SupervisorCounts) -> None:
        self.feed = feed
        self.counts = counts  # the supervisor's: notices worth a read are counted here
        self.confirmer: NoticeConfirmer = confirmer_of(feed)
        self._core = core
        self._wake = wake
        # One job per identity noticed so far (the confirmer calls a job with ``done``
        # only, so the identity is bound in); registered at the first notice worth a read.
        self._jobs: dict[LeaseIdentity, Job] = {}
        # One key for the looks of every waiting binding (Schedule.look_now): a turn reads
        # all the bindings noticed since the last one, coalesced and rate-bounded as one.
        self._looks: object = object()
        self.confirmer.register(self._looks, self._look)
        feed.subscribe_all(self._on_notice)

    def _on_notice(self, identity: LeaseIdentity, epoch: int, kind: str) -> None:
        core = self._core
        with core.lock:
            if core.closing:
                return
            # A binding waiting for a lease held elsewhere: the notice moves its next look
            # into the next turn's batched read and takes no confirming turn, so a peer's
            # shutdown releasing thousands is no flood; one read less than max_backoff ago
            # looks again now as a confirming turn, within the confirmer's bound.
            looked = core.schedule.look(identity, core.clock())
            moved = looked == "moved"
            confirm = looked == "held" and core.schedule.worth_confirming(identity, epoch)
            if moved or confirm or looked == "soon":
                self.counts.notices += 1  # acted on: a look moved or a confirming read asked
            if looked == "soon":
                self.confirmer.notice(self._looks)
            if confirm:
                if identity not in self._jobs:
                    job = self._jobs[identity] = functools.partial(self._confirm, identity)
                    self.confirmer.register(identity, job)
                self.confirmer.notice(identity)
        if moved:
            self._wake()

    def _look(self, done: Done) -> None:
        """The job of the waiting bindings' confirming turn, on the confirmer's thread:
        move their reads to now and wake the supervisor, whose next turn makes them and
        calls ``done()`` after (at once if nothing moved, or nobody can make them)."""
        core = self._core
        with core.lock:
            moved = not core.closing and core.schedule.look_now(core.clock())
            if moved:
                core.looking.append(done)
        if not moved:
            done()
        elif not self._wake():
            with core.lock:
                if done not in core.looking:
                    return  # a turn took it meanwhile
                core.looking.remove(done)
            done()

    def _confirm(self, identity: LeaseIdentity, done: Done) -> None:
        """The job of a confirming turn, on the confirmer's thread: plan the read and wake
        the supervisor, which makes it and calls ``done()`` after."""
        core = self._core
        with core.lock:
            slot = None if core.closing else core.schedule.notice(identity)
            if slot is not None:
                earlier = core.confirming.pop(slot, None)
                core.confirming[slot] = done
        if slot is None:
            done()
            return
        if earlier is not None:  # not expected: the confirmer runs one turn per identity
            earlier()
        if not self._wake():  # nobody will make the read: give the turn back
            with core.lock:
                core.confirming.pop(slot, None)
                slot.confirm = False
            done()

    def forget(self, identity: LeaseIdentity) -> None:
        """``identity`` is no longer run: its notices cost nothing again."""
        with self._core.lock:
            job = self._jobs.pop(identity, None)
            if job is not None:
                self.confirmer.unregister(identity, job)

    def close(self) -> None:
        """Stop listening: unsubscribe, and drop every job from the confirmer."""
        self.feed.unsubscribe_all(self._on_notice)
        with self._core.lock:
            jobs, self._jobs = self._jobs, {}
            for identity, job in jobs.items():
                self.confirmer.unregister(identity, job)
            self.confirmer.unregister(self._looks, self._look)
            looking, self._core.looking = self._core.looking, []
        for done in looking:  # no turn will make these reads now
            done()
