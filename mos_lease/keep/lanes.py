"""The health of a supervisor's renewal connections (lanes), so that renewal batches go
around one that hangs: see :class:`Lanes`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from mos_lease.bounded import OVERDUE
from mos_lease.errors import CommitOutcomeUnknown, StoreUnavailable
from mos_lease.keep.turn import Ended

log = logging.getLogger("mos_lease.supervisor")

R = TypeVar("R")


def answered(outcome: object) -> bool:
    """Whether a renewal call's outcome is its results (not an exception, not OVERDUE)."""
    return isinstance(outcome, Ended) and not isinstance(outcome.outcome, BaseException)


class Lanes:
    """The health of each renewal coordinator (a lane, by its id), for a supervisor that renews
    on two. A lane fails when a batch on it raises what a connection raises
    (``StoreUnavailable``, ``CommitOutcomeUnknown``; bad input or a bug says nothing of it),
    or is given up on at its limit after at least :data:`PATIENCE` seconds (a batch given
    less, its limit already near when it started, says nothing of its lane). A lane is
    avoided while a batch given up on still runs there (a thread blocked on a hung
    connection, a cancelled task that cannot end), and after a failure for a pause that
    doubles with each failure in a row, from :data:`AVOID` up to :data:`AVOID_CAP` seconds,
    counted from the end of the failed call; a batch that returns clears it. The pause is
    needed because a store's own call bound ends a hung call, and a new connection over a
    network path that stays silent hangs as well: each batch sent there would lose its
    leases at their deadlines. While one lane is avoided, the other renews every batch (as
    one connection would); when both are, they take turns as before.

    A batch sent to a lane before it was found failing is given up on at its collection
    (:meth:`forsaken`), while another lane is not avoided: its leases are retried there
    with the time they have left, instead of waiting on the failing lane until their
    deadlines."""

    __slots__ = ("_clock", "_count", "_failing", "_names", "_returned", "hedging")

    def __init__(self, clock: Callable[[], float], count: int = 1,
                 names: Mapping[int, str] | None = None) -> None:
        self._clock = clock
        self._count = count  # the lanes there are
        self._names = names or {}  # what the log calls each lane
        self._failing: dict[int, _Failing] = {}
        self._returned: dict[int, float] = {}  # the latest start of a batch that returned
        # Whether a batch still running at its patience may be sent again (idle): not
        # after a hedge lost to the call it hedged, until a batch returns within its
        # patience again (prompt): a database slow for every connection is not given
        # twice the work, tick after tick.
        self.hedging = True

    def judge(self, lane: int, outcome: object, running: Any, begun: float) -> None:
        """A batch on ``lane``, started at ``begun``, was collected: its results, its
        exception or ``OVERDUE`` (``running``: its call, which may still run)."""
        if isinstance(outcome, Ended):
            outcome = outcome.outcome
        given = self._clock() - begun
        failing = self._failing.get(lane)
        if outcome is OVERDUE and given < PATIENCE:  # no verdict: avoided while it runs
            self.lingers(lane, running)
            return
        if not (outcome is OVERDUE or isinstance(outcome, BaseException)):
            if failing is not None and failing.failures:
                log.info("mos_lease: %s renews again", self._name(lane))
            self._failing.pop(lane, None)
            self.returned(lane, begun)
            return
        if outcome is not OVERDUE and not isinstance(outcome, StoreUnavailable
                                                     | CommitOutcomeUnknown):
            return  # bad input, a bug: nothing said of the connection
        failures = 1 if failing is None else failing.failures + 1
        failing = self._failing[lane] = _Failing(
            failures, min(AVOID * 2 ** min(failures - 1, 16), AVOID_CAP))
        if failures == 1:  # once a run of failures: the pause grows while it lasts
            log.warning("mos_lease: %s failing (%s); the other renews every batch while "
                        "the call runs and for %g s after", self._name(lane),
                        f"given up on after {given:.2f} s" if outcome is OVERDUE
                        else f"{type(outcome).__name__}: {outcome}", failing.pause)
        if outcome is OVERDUE:
            failing.running = running  # the pause counts from its end
        else:
            failing.until = self._clock() + failing.pause

    @classmethod
    def of(cls, clock: Callable[[], float], renewers: Sequence[object]) -> Lanes:
        """The lanes of ``renewers`` (by id), named in the log by their place."""
        return cls(clock, max(len(renewers), 1), {
            id(r): f"renewal coordinator {i} of {len(renewers)}"
            for i, r in enumerate(renewers, 1)})

    def lingers(self, lane: int, running: Any) -> None:
        """A call on ``lane`` was left running with no verdict on the lane (given up on
        too soon to say, or a hedge that lost): the lane is avoided while it runs, since
        a batch sent there would wait behind it on the connection."""
        failing = self._failing.get(lane)
        if failing is None:
            failing = self._failing[lane] = _Failing(0, 0.0)
        if failing.running is None or failing.running.done():
            failing.running = running

    def wasted(self) -> None:
        """A hedge lost to the call it hedged, which returned its results: the database,
        not a connection, was slow. No hedge until :meth:`prompt` (the hedge's lane
        :meth:`lingers` while it runs on, as any call left running)."""
        self.hedging = False

    def prompt(self) -> None:
        """A batch returned within its patience: hedges may be sent again."""
        self.hedging = True

    def idle(self, renewers: Sequence[R], busy: Iterable[int]) -> R | None:
        """The first of ``renewers`` not avoided with no batch on it (``busy``: the lanes
        with one): where a batch still running elsewhere may be sent again (``None``
        while hedges are held back, :meth:`wasted`)."""
        if not self.hedging:
            return None
        taken = set(busy)
        return next((r for r in renewers if id(r) not in taken and not self.avoided(id(r))),
                    None)

    def _name(self, lane: int) -> str:
        return self._names.get(lane, "a renewal coordinator")

    def returned(self, lane: int, begun: float) -> None:
        """A batch on ``lane`` that started at ``begun`` returned its results."""
        self._returned[lane] = max(self._returned.get(lane, begun), begun)

    def outpaced(self, lane: int, begun: float,
                 ended: Iterable[tuple[int, float, object]] = ()) -> bool:
        """Whether another lane returned a batch that started no earlier than ``begun``
        (a batch's on ``lane`` still running): that lane, not the database, is slow.
        ``ended``: batches ended but not yet collected, as (lane, start, outcome)."""
        for other, started, outcome in ended:
            if answered(outcome):
                self.returned(other, started)
        return any(other != lane and started >= begun
                   for other, started in self._returned.items())

    def forsaken(self, lane: int) -> bool:
        """Whether a batch on ``lane`` not yet ended is to be given up on now: the lane is
        avoided and another is not."""
        avoided = [other for other in list(self._failing) if self.avoided(other)]
        return lane in avoided and len(avoided) < self._count

    def avoided(self, lane: int) -> bool:
        """Whether ``lane`` (a coordinator's id) is to be passed over now."""
        failing = self._failing.get(lane)
        if failing is None:
            return False
        if failing.running is not None:
            if not failing.running.done():
                return True
            # Ended (seen now, or at the latest at the next batch): the pause counts from here.
            failing.running, failing.until = None, self._clock() + failing.pause
        return self._clock() < failing.until


class _Failing:
    """A lane's failures in a row, the pause they earn, the call given up on while it may
    still run, and until when the lane is avoided once that call has ended."""

    __slots__ = ("failures", "pause", "running", "until")

    def __init__(self, failures: int, pause: float) -> None:
        self.failures = failures
        self.pause = pause
        self.running: Any = None
        self.until = 0.0

PATIENCE = 0.25
"""Seconds a renewal batch must have been given, to count as its lane's failure when it is
given up on (a batch of 1,000 renewals takes 20-150 ms on PostgreSQL on two cores)."""
AVOID = 30.0
"""Seconds a renewal lane is passed over after its first failure in a row (see
:class:`Lanes`)."""
AVOID_CAP = 300.0
"""The longest pause of a failing renewal lane, in seconds."""
