"""The telemetry of one coordinator operation, reported to an ``on_event`` hook.

A coordinator built with a hook makes one :class:`Observation` per operation and tells it
each store call as it starts and ends, and the operation's result; without a hook nothing
here runs. The flows themselves stay untouched.
"""

from __future__ import annotations

import time
from uuid import UUID

from mos_lease.clock import MonotonicClock
from mos_lease.events import Emitter, OperationFinished, StoreCall
from mos_lease.records import AuditEntry
from mos_lease.results import ValidationResult
from mos_lease.store_ops import Apply, LoadMany, Op, Record, RenewMany, WriteMany, store_call
from mos_lease.vocabulary import LifecycleEvent, Outcome


class Observation:
    """Which lifecycle attempts an operation made, and how each ended, is read from the audit
    entries its flow hands the store: an attempt's entries share its event id, and the last
    one handed over is the one that stood (a write that lost a race is followed by the
    retry's write or by the refusal)."""

    __slots__ = ("_began", "_clock", "_emit", "_entries", "_system")

    def __init__(self, emit: Emitter, clock: MonotonicClock, system: str) -> None:
        self._emit = emit
        self._clock = clock
        self._system = system
        self._entries: dict[UUID, AuditEntry] = {}
        self._began = clock()

    def start(self, op: Op) -> tuple[int, float]:
        """Note ``op``'s audit entries; return the wall and monotonic times it starts at."""
        if isinstance(op, Apply | Record):
            self._entries[op.entry.event_id] = op.entry
        elif isinstance(op, RenewMany | WriteMany):
            for _write, entry in op.items:
                self._entries[entry.event_id] = entry
        return time.time_ns(), self._clock()

    def called(self, op: Op, started: tuple[int, float], error: BaseException | None) -> None:
        """Report the store call ``op`` that began at ``started``, failed with ``error``."""
        wall, began = started
        self._emit(StoreCall(store_call(op)[0], self._system, wall, self._clock() - began,
                             None if error is None else type(error).__name__,
                             _count(op)))

    def finish(self, result: object) -> None:
        """Report every attempt the operation made, and a successful validation."""
        duration = self._clock() - self._began
        for entry in self._entries.values():
            self._emit(OperationFinished.of(entry, duration))
        if isinstance(result, ValidationResult) and result.context is not None:
            # A successful validation writes no audit row, but it is the hottest operation
            # and its latency is what a dashboard most wants.
            ctx = result.context
            identity = ctx.identity
            self._emit(OperationFinished(
                LifecycleEvent.GRANT_VALIDATE, identity.tenant_id, identity.logical_agent_id,
                identity.binding_id, ctx.connector_id, ctx.epoch, Outcome.VALIDATED, None,
                duration, ctx.correlation_id))


def _count(op: Op) -> int:
    """How many leases a store call stands for: a batch's items, else one."""
    if isinstance(op, RenewMany | WriteMany):
        return len(op.items)
    if isinstance(op, LoadMany):
        return len(op.identities)
    return 1
