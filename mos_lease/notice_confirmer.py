"""The confirming turns of lease notices, run for the whole process by one thread.

A notice source (``mos_lease_pg.notices.LeaseNotices``) hands every notice for a key (a
lease identity) to :meth:`NoticeConfirmer.notice`, which costs a dictionary look-up: no
read, no thread, no task. The :class:`~mos_lease.notice_gate.NoticeGate` coalesces the
notices per key and bounds the turns for the process; the confirmer's one thread starts
each turn it allows by calling the *jobs* registered for the key::

    confirmer.register(identity, job)   # job(done): confirm, then call done() once
    confirmer.notice(identity)          # from any thread, as often as notices come
    confirmer.unregister(identity, job)

A key is a lease identity; every holder or waiter of it in the process registers its job,
and each turn runs them all (normally one). A job of a thread holder reads on the
confirmer's thread (so a read that hangs holds up the other keys' turns for at most the
store's call bound) and calls ``done()`` after; a job of an asyncio holder hands the read to
its loop and calls ``done()`` there when the read is over. The turn is over when every job
of it said done, so "at most one in flight per key" holds for both kinds, with the rule
written once in the gate. A job that raises is logged and counts as done.

One confirmer serves the process (:func:`shared_confirmer`) unless a source is given one
of its own; its thread starts at the first notice and ends when no key is registered.
When the rate bound first holds a turn back, one WARNING goes to the ``mos_lease.notices``
logger (again only after a quiet spell; see :mod:`~mos_lease.notice_gate`);
:meth:`NoticeConfirmer.stats` has the counts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

from mos_lease.clock import default_clock
from mos_lease.errors import ConfigurationError
from mos_lease.notice_gate import (
    DEFAULT_BURST,
    DEFAULT_QUIET,
    DEFAULT_RATE,
    NoticeGate,
    NoticeStats,
    Turn,
)

log = logging.getLogger("mos_lease.notices")

Done = Callable[[], None]
Job = Callable[[Done], object]
"""``job(done)``: start confirming; call ``done()`` once it is over (from any thread)."""


class NoticeConfirmer:
    """Coalesced, rate-bounded confirming turns (see the module's docstring).

    ``rate`` (turns per second) and ``burst`` bound the turns of every key together;
    ``quiet`` is how long the bound must hold nothing back before a new flood is warned of
    again. ``clock``: monotonic seconds, injectable for tests.
    """

    def __init__(self, *, rate: float = DEFAULT_RATE, burst: int = DEFAULT_BURST,
                 quiet: float = DEFAULT_QUIET,
                 clock: Callable[[], float] = default_clock) -> None:
        if not callable(clock):
            raise ConfigurationError("clock must be callable")
        self._gate: NoticeGate[Hashable] = NoticeGate(rate, burst, quiet=quiet)
        self._clock = clock
        self._jobs: dict[Hashable, list[Job]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def rate(self) -> float:
        """Confirming turns per second the bound lets start, across every key."""
        return self._gate.rate

    @property
    def burst(self) -> int:
        """Turns that may start at once before the rate applies."""
        return self._gate.burst

    def stats(self) -> NoticeStats:
        """The counts so far (notices, coalesced, confirmations, held back)."""
        with self._cond:
            return self._gate.stats

    def register(self, key: Hashable, job: Job) -> None:
        """Run ``job`` in every confirming turn of ``key``."""
        if not callable(job):
            raise ConfigurationError("job must be callable")
        with self._cond:
            self._jobs.setdefault(key, []).append(job)

    def unregister(self, key: Hashable, job: Job) -> None:
        """Stop running ``job`` for ``key`` (nothing if it was not registered). A turn
        already started still runs to its end."""
        with self._cond:
            jobs = self._jobs.get(key, [])
            if job in jobs:
                jobs.remove(job)
            if not jobs:
                self._jobs.pop(key, None)
                self._gate.forget(key)
            self._cond.notify()  # an idle thread with nothing registered may end

    def notice(self, key: Hashable) -> None:
        """A notice for ``key`` came: queue a confirming turn, unless one is already
        queued or running (then it is coalesced). Safe from any thread, and cheap."""
        with self._cond:
            if key not in self._jobs:
                return  # nobody here confirms it: nothing to do
            queued = not self._gate.pending(key)
            self._gate.notice(key)
            if queued:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="mos-lease-notice-confirmer")
                    self._thread.start()
                self._cond.notify()

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._gate.due(self._clock())
                starts = [(turn, list(self._jobs.get(turn.key, ()))) for turn in due.turns]
                stats = self._gate.stats if due.warn else None
                if not starts and stats is None:
                    if due.wait is None and not self._jobs:
                        self._thread = None  # the next notice starts another
                        return
                    self._cond.wait(due.wait)
                    continue
            if stats is not None:
                log.warning("mos_lease: lease notices arrive faster than the %g confirming "
                            "reads per second (burst %d) this process allows: they are "
                            "coalesced and held back (notices %d, coalesced %d, reads %d). "
                            "Notices are only hints and anyone who can log in may send "
                            "them: holders keep renewing and waiters keep polling. Warned "
                            "once per flood.", self.rate, self.burst, stats.notices,
                            stats.coalesced, stats.confirmations)
            for turn, jobs in starts:
                self._start(turn, jobs)

    def _start(self, turn: Turn[Hashable], jobs: list[Job]) -> None:
        left = [len(jobs)]

        def done_once() -> Done:
            called = [False]

            def done() -> None:
                with self._cond:
                    if called[0]:
                        return
                    called[0] = True
                    left[0] -= 1
                    if left[0] <= 0:
                        self._gate.done(turn)
                        self._cond.notify()  # it may be queued once more
            return done

        if not jobs:
            with self._cond:
                self._gate.done(turn)
            return
        for job in jobs:
            done = done_once()
            try:
                job(done)
            except Exception:
                log.exception("mos_lease: a lease notice confirmation failed")
                done()


_shared: list[NoticeConfirmer] = []  # the one of the process, once made
_shared_lock = threading.Lock()


def shared_confirmer() -> NoticeConfirmer:
    """The process's confirmer (made at first use, with the default bound)."""
    with _shared_lock:
        if not _shared:
            _shared.append(NoticeConfirmer())
        return _shared[0]


def confirmer_of(source: object) -> NoticeConfirmer:
    """The confirmer a notice source names as ``confirmer`` (``LeaseNotices`` does), else
    the process's: either way one bound for every holder and supervisor that share it."""
    confirmer = getattr(source, "confirmer", None)
    return confirmer if isinstance(confirmer, NoticeConfirmer) else shared_confirmer()
