"""The supervisor's timelines: the slots ordered by one of their times, so that a turn finds
what is due without looking at the others.

A :class:`Timeline` is a binary heap of ``(time, slot)`` entries with *lazy deletion*: a slot
whose time changes is pushed again, and its old entry stays where it is until it comes to
the top, where the validity test the schedule gives :class:`Timeline` tells it is stale by the
slot's ``version``. Pushing is O(log n), and so is popping each due entry; an entry is
dropped once, so the stale ones cost no more than the pushes that made them. When they
outnumber the live ones the heap is rebuilt from the live ones (O(n), once per as many
pushes), so its size stays within a constant factor of the slots.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from mos_lease.supervisor.slots import Slot

_Entry = tuple[float, int, int, Slot]  # time, a tie-breaker, the slot's version, the slot


class Timeline:
    """Slots by time. ``valid(slot, version)`` says whether an entry pushed at ``version`` is
    still the slot's place here (the schedule decides: a removed slot, a changed time, a
    busy slot on a timeline of free ones)."""

    def __init__(self, valid: Callable[[Slot, int], bool]) -> None:
        self._valid = valid
        self._heap: list[_Entry] = []
        self._order = itertools.count()  # entries of equal time never compare their slots

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, at: float, slot: Slot) -> None:
        heapq.heappush(self._heap, (at, next(self._order), slot.version, slot))

    def first(self) -> float:
        """The earliest time of a valid entry (``inf`` if none); stale entries on top are
        dropped on the way."""
        heap = self._heap
        while heap:
            at, _, version, slot = heap[0]
            if self._valid(slot, version):
                return at
            heapq.heappop(heap)
        return math.inf

    def pop_until(self, now: float, keep: Callable[[Slot], bool] | None = None
                  ) -> list[Slot]:
        """Take out the slots whose valid entries are due at ``now``; those ``keep`` says
        stay are put back (this costs in proportion to the entries due)."""
        heap = self._heap
        due: list[Slot] = []
        kept: list[_Entry] = []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            slot = entry[3]
            if not self._valid(slot, entry[2]):
                continue
            if keep is not None and keep(slot):
                kept.append(entry)
            else:
                due.append(slot)
        for entry in kept:
            heapq.heappush(heap, entry)
        return due

    def first_except(self, skip: Callable[[Slot], bool]) -> float:
        """The earliest time of a valid entry whose slot is not skipped (``inf`` if none).
        The skipped entries met on the way are taken out and put back: this costs in
        proportion to how many come first."""
        heap = self._heap
        kept: list[_Entry] = []
        found = math.inf
        while heap:
            entry = heap[0]
            at, _, version, slot = entry
            if not self._valid(slot, version):
                heapq.heappop(heap)
            elif skip(slot):
                kept.append(heapq.heappop(heap))
            else:
                found = at
                break
        for entry in kept:
            heapq.heappush(heap, entry)
        return found

    def compact(self, live: int) -> None:
        """Rebuild from the valid entries if the stale ones outnumber the ``live`` slots
        (with some room, so a small schedule is not rebuilt all the time)."""
        if len(self._heap) > 2 * live + 64:
            self._heap = [e for e in self._heap if self._valid(e[3], e[2])]
            heapq.heapify(self._heap)
