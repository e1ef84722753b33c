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
import time
from uuid import UUID

LOW_BITS = 74
"""The bits of a version-7 UUID that are neither its time nor its version and variant."""
_RAND_A = (1 << 12) - 1
_RAND_B = (1 << 62) - 1
_VERSION_7 = 0x7 << 76
_VARIANT = 0b10 << 62


def uuid7(now_ns: int | None = None) -> UUID:
    """A fresh version-7 UUID: the millisecond of ``now_ns`` (default: the wall clock,
    ``time.time_ns()``), the version and variant bits, and 74 random bits."""
    ms = (time.time_ns() if now_ns is None else now_ns) // 1_000_000
    return uuid7_of(ms, int.from_bytes(os.urandom(10), "big"))


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
