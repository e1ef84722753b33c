"""The in-memory store's clocks, importable from their former place; they live in
:mod:`mos_lease.clock`."""

from mos_lease.clock import ManualClock, SystemClock

__all__ = ["ManualClock", "SystemClock"]
