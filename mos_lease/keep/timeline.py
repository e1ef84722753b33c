"""The supervisor's timelines: the slots ordered by one of their times, so that a turn finds
what is due without looking at the others.

A :class:`Timeline` keeps its slots in *buckets*, one per distinct time, and the times in a
binary heap. The supervisor's bindings share their times (a renewal tick gives every lease
of a batch the same deadline and all of them the same next renewal, as jitter is 0 by
default), so adding a slot is mostly an append to a bucket that exists, and taking out
what is due is a pop per distinct time plus a step per slot.

Deletion is *lazy*: a slot whose time changes is pushed again, and its old entry stays in
its bucket until that bucket comes to the top, where the validity test the schedule gives
:class:`Timeline` tells it is stale by the slot's ``version``. An entry is dropped once, so
the stale ones cost no more than the pushes that made them. When they outnumber the live
slots the timeline is rebuilt from the live ones (O(n), once per as many pushes), so its
size stays within a constant factor of the slots.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from mos_lease.keep.slots import Slot

_Entry = tuple[int, Slot]  # the slot's version when pushed, the slot


class Timeline:
    """Slots by time. ``valid(slot, version)`` says whether an entry pushed at ``version`` is
    still the slot's place here (the schedule decides: a removed slot, a changed time, a
    busy slot on a timeline of free ones)."""

    def __init__(self, valid: Callable[[Slot, int], bool]) -> None:
        self._valid = valid
        self._times: list[float] = []  # a heap of the times that have a bucket
        self._buckets: dict[float, list[_Entry]] = {}
        self._size = 0  # entries held, stale ones included

    def __len__(self) -> int:
        return self._size

    def push(self, at: float, slot: Slot) -> None:
        bucket = self._buckets.get(at)
        if bucket is None:
            bucket = self._buckets[at] = []
            heapq.heappush(self._times, at)
        bucket.append((slot.version, slot))
        self._size += 1

    def first(self) -> float:
        """The earliest time of a valid entry (``inf`` if none); stale entries on top are
        dropped on the way."""
        times, buckets, valid = self._times, self._buckets, self._valid
        while times:
            at = times[0]
            bucket = buckets[at]
            for k, (version, slot) in enumerate(bucket):
                if valid(slot, version):
                    if k:
                        del bucket[:k]
                        self._size -= k
                    return at
            self._size -= len(bucket)
            del buckets[at]
            heapq.heappop(times)
        return math.inf

    def pop_until(self, now: float, keep: Callable[[Slot], bool] | None = None
                  ) -> list[Slot]:
        """Take out the slots whose valid entries are due at ``now``; those ``keep`` says
        stay are put back (this costs in proportion to the entries due)."""
        times, buckets, valid = self._times, self._buckets, self._valid
        due: list[Slot] = []
        kept: list[tuple[float, Slot]] = []
        while times and times[0] <= now:
            at = heapq.heappop(times)
            bucket = buckets.pop(at)
            self._size -= len(bucket)
            for version, slot in bucket:
                if valid(slot, version):
                    if keep is not None and keep(slot):
                        kept.append((at, slot))
                    else:
                        due.append(slot)
        for at, slot in kept:
            self.push(at, slot)
        return due

    def first_except(self, skip: Callable[[Slot], bool]) -> float:
        """The earliest time of a valid entry whose slot is not skipped (``inf`` if none).
        The times whose slots are all skipped are set aside on the way and put back: this
        costs in proportion to the skipped slots that come first."""
        aside: list[float] = []
        found = math.inf
        while (at := self.first()) != math.inf:
            if any(self._valid(slot, version) and not skip(slot)
                   for version, slot in self._buckets[at]):
                found = at
                break
            aside.append(heapq.heappop(self._times))
        for at in aside:
            heapq.heappush(self._times, at)
        return found

    def compact(self, live: int) -> None:
        """Rebuild from the valid entries if the stale ones outnumber the ``live`` slots
        (with some room, so a small schedule is not rebuilt all the time)."""
        if self._size <= 2 * live + 64:
            return
        valid = self._valid
        buckets = {at: kept for at, bucket in self._buckets.items()
                   if (kept := [(v, s) for v, s in bucket if valid(s, v)])}
        self._buckets = buckets
        self._times = list(buckets)
        heapq.heapify(self._times)
        self._size = sum(len(bucket) for bucket in buckets.values())
