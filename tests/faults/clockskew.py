"""A gateway process whose clocks are wrong: offset by minutes and running fast or slow.

Scenario 7 runs a worker with ``python -m tests.faults.clockskew OFFSET RATE -- ARGS...``:
before anything else is imported, every clock a Python gateway could consult is replaced by
``real_start + offset + rate * (real_now - real_start)``: ``time.time``, ``time.monotonic``,
``time.perf_counter``, ``time.clock_gettime`` (realtime, monotonic and boottime: the lease
keeper uses boottime) and their ``_ns`` twins. ``datetime.now``/``utcnow``/``today`` cannot be
patched on the C type, so the library's own modules get a ``datetime`` subclass that reads the
skewed clock and still accepts every real ``datetime`` in ``isinstance`` checks.

The library must not care: the database clock decides. A decision that follows the
gateway's clock instead shows up as a difference from the database-time oracle.

This module imports nothing from the library or the test suite at import time, so that the
patch is in place before they are loaded.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import runpy
import sys
import time
from collections.abc import Callable
from typing import Any, Self

_REAL_TIME = time.time
_REAL_MONOTONIC = time.monotonic
_REAL_PERF = time.perf_counter
_REAL_CLOCK_GETTIME = time.clock_gettime
_REAL_DATETIME = _dt.datetime

_state: dict[str, float] = {}


def real_monotonic() -> float:
    """The host's monotonic clock, whatever this process's clocks were made to say."""
    return _REAL_MONOTONIC()


def real_wall() -> float:
    return _REAL_TIME()


def installed() -> tuple[float, float] | None:
    """``(offset, rate)`` if this process runs skewed."""
    if not _state:
        return None
    return _state["offset"], _state["rate"]


def gained() -> float:
    """Seconds the skewed wall clock has gained on its offset since it was installed (at a
    rate other than 1 the offset grows with real time); 0 where nothing is skewed."""
    if not _state:
        return 0.0
    return (_state["rate"] - 1.0) * (_REAL_TIME() - _state["wall"])


def _skew(real_start: float, real_now: float, offset: float, rate: float) -> float:
    return real_start + offset + rate * (real_now - real_start)


class _AcceptsRealDatetimes(type):
    # The subclass below replaces ``datetime`` inside the library's modules; values made by
    # psycopg or the standard library are plain datetimes and must still pass isinstance.
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _REAL_DATETIME)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _REAL_DATETIME)


def install(offset: float, rate: float) -> None:
    """Skew every clock of this process by ``offset`` seconds at ``rate`` x real speed."""
    if _state:
        raise RuntimeError("clocks already skewed")
    anchors = {
        "wall": _REAL_TIME(), "mono": _REAL_MONOTONIC(), "perf": _REAL_PERF(),
    }
    clock_ids = {time.CLOCK_REALTIME: "wall", time.CLOCK_MONOTONIC: "mono"}
    if hasattr(time, "CLOCK_BOOTTIME"):
        anchors["boot"] = _REAL_CLOCK_GETTIME(time.CLOCK_BOOTTIME)
        clock_ids[time.CLOCK_BOOTTIME] = "boot"
    real_of: dict[str, Callable[[], float]] = {
        "wall": _REAL_TIME, "mono": _REAL_MONOTONIC, "perf": _REAL_PERF,
        "boot": lambda: _REAL_CLOCK_GETTIME(time.CLOCK_BOOTTIME),
    }
    _state.update(offset=offset, rate=rate, wall=anchors["wall"])

    def skewed(name: str, with_offset: bool = True) -> float:
        start = anchors[name]
        return _skew(start, real_of[name](), offset if with_offset else 0.0, rate)

    def fake_clock_gettime(clock_id: int) -> float:
        name = clock_ids.get(clock_id)
        return skewed(name) if name is not None else _REAL_CLOCK_GETTIME(clock_id)

    patches: dict[str, Any] = {
        "time": lambda: skewed("wall"),
        "time_ns": lambda: int(skewed("wall") * 1e9),
        # Monotonic clocks are offset too: their origin is arbitrary, only the rate matters,
        # and an offset catches code that mixes them with wall time.
        "monotonic": lambda: skewed("mono"),
        "monotonic_ns": lambda: int(skewed("mono") * 1e9),
        "perf_counter": lambda: skewed("perf"),
        "perf_counter_ns": lambda: int(skewed("perf") * 1e9),
        "clock_gettime": fake_clock_gettime,
        "clock_gettime_ns": lambda clock_id: int(fake_clock_gettime(clock_id) * 1e9),
    }
    for name, value in patches.items():
        setattr(time, name, value)


def skewed_datetime() -> type[_dt.datetime]:
    """A ``datetime`` class whose ``now``/``utcnow``/``today`` read the skewed clock."""

    class SkewedDateTime(_REAL_DATETIME, metaclass=_AcceptsRealDatetimes):
        @classmethod
        def now(cls, tz: _dt.tzinfo | None = None) -> Self:
            return cls.fromtimestamp(time.time(), tz)

        @classmethod
        def utcnow(cls) -> Self:
            return cls.fromtimestamp(time.time(), _dt.UTC).replace(tzinfo=None)

        @classmethod
        def today(cls) -> Self:
            return cls.fromtimestamp(time.time())

    return SkewedDateTime


def patch_library_datetimes(prefixes: tuple[str, ...] = ("mos_lease",)) -> int:
    """Give every loaded module of the library the skewed ``datetime``; returns how many
    module attributes were replaced."""
    fake = skewed_datetime()
    replaced = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for attr, value in list(vars(module).items()):
            if value is _REAL_DATETIME:
                setattr(module, attr, fake)
                replaced += 1
    return replaced


def main(argv: list[str]) -> None:
    """``OFFSET RATE -- module args...``: skew, then run ``module`` as ``__main__``."""
    offset, rate = float(argv[1]), float(argv[2])
    if argv[3] != "--":
        raise SystemExit("usage: python -m tests.faults.clockskew OFFSET RATE -- MODULE ARGS")
    # Install through the module's importable name: the worker imports it by that name and
    # must find the real clocks it captured before the patch, not a second copy of this
    # file loaded as __main__ after it.
    importlib.import_module("tests.faults.clockskew").install(offset, rate)
    sys.argv = argv[4:]
    runpy.run_module(argv[4], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
