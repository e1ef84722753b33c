"""Ids: time-ordered UUIDs (version 7, RFC 9562), the coordinator's default id source.

An audit event id carries the millisecond it was minted in its first 48 bits. The
PostgreSQL store holds event ids unique by that time: a month partition of the audit log
accepts only ids minted within its month (widened by a day on either side) and refuses one
twice through its own unique index, so no id needs a second row to be checked against every
month (migration 0009). An id source given to the coordinator must mint ids the same way
from a clock within a day of the database's; the in-memory store accepts any UUID.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Final
from uuid import UUID

LOW_BITS = 74
"""The bits of a version-7 UUID that are neither its time nor its version and variant."""
_RAND_A = (1 << 12) - 1
_RAND_B = (1 << 62) - 1
_VERSION_7 = 0x7 << 76
_VARIANT = 0b10 << 62


_DRAW: Final = 10  # bytes of randomness per id: 80 bits, of which 74 are used
_POOL: Final = 4096 // _DRAW * _DRAW  # bytes asked of the kernel at once


class _RandomPool:
    """The random bits of this process's ids, asked of the kernel's CSPRNG (``os.urandom``)
    4 KiB at a time: a write mints two ids, and a system call per id cost more than the
    rest of minting it. Emptied in a forked child, which must never reuse its parent's
    bytes (two processes would mint the same ids)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = b""
        self._at = 0

    def draw(self) -> int:
        with self._lock:
            at = self._at
            if at == len(self._bytes):
                self._bytes, at = os.urandom(_POOL), 0
            self._at = at + _DRAW
            return int.from_bytes(self._bytes[at:at + _DRAW], "big")

    def forked(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at fork time
        self._bytes, self._at = b"", 0


_RANDOM: Final = _RandomPool()
os.register_at_fork(after_in_child=_RANDOM.forked)


def uuid7(now_ns: int | None = None) -> UUID:
    """A fresh version-7 UUID: the millisecond of ``now_ns`` (default: the wall clock,
    ``time.time_ns()``), the version and variant bits, and 74 random bits."""
    ms = (time.time_ns() if now_ns is None else now_ns) // 1_000_000
    return uuid7_of(ms, _RANDOM.draw())


def uuid7_of(ms: int, low: int) -> UUID:
    """The version-7 UUID of Unix millisecond ``ms`` whose other bits are the low 74 bits of
    ``low`` (for reproducible id sources: a fixed millisecond and a counter)."""
    if not 0 <= ms < 1 << 48:
        raise ValueError(f"a version-7 UUID holds a millisecond in 48 bits, not {ms!r}")
    return UUID(int=(ms << 80) | _VERSION_7 | ((low >> 62) & _RAND_A) << 64 | _VARIANT
                | (low & _RAND_B))


def minted_ms(value: UUID) -> int | None:
    """The Unix millisecond a version-7 UUID was minted at, or ``None`` for another version."""
    return value.int >> 80 if value.version == 7 else None
