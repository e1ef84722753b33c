"""Notices are rate-bounded hints: the rule that turns any stream of lease notices into a
bounded stream of confirming reads.

Anyone who can log in to the database may send ``NOTIFY`` on any channel: one unprivileged
statement sends 50,000 well-formed notices in a tenth of a second. A notice therefore
never decides anything; the most it may cause is a *confirming turn* (a holder reads the
row to see whether its epoch was superseded, a waiter looks again), and the gate bounds
those turns whatever arrives:

* **Coalesced per key** (a lease identity). A key is idle, *queued* (a notice came, its turn
  has not started) or *running* (its turn started and is not done). A notice for a queued
  key changes nothing; one for a running key marks it to be queued once more when done (a
  read that began before the change it was told of may have missed it). So at most one
  turn per key is in flight and at most one more waits behind it, however many notices
  come.
* **Rate-bounded for the process.** Every turn spends a token of one bucket that holds at
  most ``burst`` tokens and refills at ``rate`` per second, so over any stretch of ``T``
  seconds at most ``burst + rate * T`` turns start, however many keys and notices there
  are. Keys take their turns in the order they were queued: a flood on one identity holds
  another identity's turn back by at most one turn of each key queued before it.
* **Visible.** :class:`NoticeStats` counts notices, coalesced notices, turns started and
  turns held back by the bound; :meth:`NoticeGate.due` says when to log a WARNING: once when
  the bound first holds a turn back, and again only after ``quiet`` seconds in which it held
  none back.

The gate is pure: it is given the time (monotonic seconds) and only says which turns start
now; :mod:`mos_lease.notice_confirmer` runs them, for threads and asyncio alike.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Final, Generic, TypeVar

import attrs

from mos_lease.errors import ConfigurationError

K = TypeVar("K", bound=Hashable)

DEFAULT_RATE: Final = 20.0
"""Confirming turns per second for the whole process, by default."""
DEFAULT_BURST: Final = 10
"""Confirming turns that may start at once after a quiet spell, by default."""
DEFAULT_QUIET: Final = 60.0
"""Seconds without a held-back turn after which a new flood is warned of again."""
# A token refilled in steps of a float's rounding is still a token.
_ROUNDING: Final = 1e-9


@attrs.frozen(slots=True)
class NoticeStats:
    """What the gate has seen since it was made (counts only; never a payload).

    ``notices``: notices offered for keys that someone confirms. ``coalesced``: those that
    caused no turn of their own (their key's turn was already queued, or running and
    already marked to run once more). ``confirmations``: turns started, each one confirming
    read (or one waiter's wake-up) per subscriber of its key. ``held_back``: turns that
    waited at the head of the queue for the rate bound; more than zero means notices came
    faster than the bound lets turns start (a flood, forged or not).
    """

    notices: int = 0
    coalesced: int = 0
    confirmations: int = 0
    held_back: int = 0


@attrs.frozen(slots=True)
class Turn(Generic[K]):
    """One confirming turn that may start now; hand ``number`` back to :meth:`NoticeGate.
    done` (a turn of a key that was forgotten and offered again is told apart by it)."""

    key: K
    number: int


@attrs.frozen(slots=True)
class Due(Generic[K]):
    """What :meth:`NoticeGate.due` decided: the turns to start now; ``wait``, the seconds
    until another could start (``None``: nothing is queued); ``warn``, whether to log the
    one WARNING of a flood now."""

    turns: tuple[Turn[K], ...]
    wait: float | None
    warn: bool


@attrs.define(slots=True)
class _Running:
    number: int
    again: bool = False  # a notice came while running: queue once more when done


class NoticeGate(Generic[K]):
    """Per-key coalescing and one token bucket (see the module's docstring). Not
    thread-safe: its one user serializes the calls."""

    def __init__(self, rate: float = DEFAULT_RATE, burst: int = DEFAULT_BURST, *,
                 quiet: float = DEFAULT_QUIET) -> None:
        if isinstance(rate, bool) or not isinstance(rate, int | float) \
                or not (math.isfinite(rate) and rate > 0):
            raise ConfigurationError(f"rate must be a positive number of turns per second, "
                                     f"not {rate!r:.40}")
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ConfigurationError(f"burst must be a whole number >= 1, not {burst!r:.40}")
        if isinstance(quiet, bool) or not isinstance(quiet, int | float) \
                or not (math.isfinite(quiet) and quiet >= 0):
            raise ConfigurationError(f"quiet must be a non-negative number of seconds, "
                                     f"not {quiet!r:.40}")
        self.rate = float(rate)
        self.burst = burst
        self.quiet = float(quiet)
        self._tokens = float(burst)
        self._filled_at: float | None = None
        # Keys waiting for their turn, oldest first (a dict: ordered, O(1) removal).
        self._queue: dict[K, None] = {}
        self._held: K | None = None  # the queue's head, once counted as held back
        self._running: dict[K, _Running] = {}
        self._numbers = 0
        self._last_held_back: float | None = None
        self._notices = self._coalesced = self._confirmations = self._held_back = 0

    @property
    def stats(self) -> NoticeStats:
        """What the gate has seen and done since it was made (see :class:`NoticeStats`)."""
        return NoticeStats(self._notices, self._coalesced, self._confirmations,
                           self._held_back)

    def pending(self, key: K) -> bool:
        """Whether ``key`` has a turn queued or running."""
        return key in self._queue or key in self._running

    def notice(self, key: K) -> None:
        """A notice for ``key`` came (what it said is not taken into account)."""
        self._notices += 1
        running = self._running.get(key)
        if key in self._queue or (running is not None and running.again):
            self._coalesced += 1
        elif running is not None:
            running.again = True
        else:
            self._queue[key] = None

    def due(self, now: float) -> Due[K]:
        """The turns that start at ``now`` (each marked running), oldest key first."""
        self._refill(now)
        turns: list[Turn[K]] = []
        while self._queue and self._tokens >= 1.0 - _ROUNDING:
            key = next(iter(self._queue))
            del self._queue[key]
            if key == self._held:
                self._held = None
            self._tokens -= 1.0
            self._numbers += 1
            self._running[key] = _Running(self._numbers)
            self._confirmations += 1
            turns.append(Turn(key, self._numbers))
        if not self._queue:
            return Due(tuple(turns), None, False)
        warn = False
        head = next(iter(self._queue))
        if self._held != head:  # counted once per turn, however often it is looked at
            self._held = head
            self._held_back += 1
            last = self._last_held_back
            warn = last is None or now - last >= self.quiet
        self._last_held_back = now
        return Due(tuple(turns), max(1.0 - self._tokens, _ROUNDING) / self.rate, warn)

    def done(self, turn: Turn[K]) -> None:
        """``turn`` has finished; its key is idle again, or queued once more if a notice
        came meanwhile. A turn no longer running (its key was forgotten) is ignored."""
        running = self._running.get(turn.key)
        if running is None or running.number != turn.number:
            return
        del self._running[turn.key]
        if running.again:
            self._queue[turn.key] = None

    def forget(self, key: K) -> None:
        """Drop whatever is queued or running for ``key`` (nobody confirms it any more)."""
        self._queue.pop(key, None)
        self._running.pop(key, None)
        if key == self._held:
            self._held = None

    def _refill(self, now: float) -> None:
        if self._filled_at is not None and now > self._filled_at:
            self._tokens = min(float(self.burst),
                               self._tokens + (now - self._filled_at) * self.rate)
        if self._filled_at is None or now > self._filled_at:
            self._filled_at = now  # a clock that steps back refills nothing
