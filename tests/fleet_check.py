"""Checks of a fleet run over the in-memory store, shared by the fleet supervisor tests: a
store that records every takeover with the row it replaced (a takeover of an active lease is
a preemption the fleet must never ask for, whatever the policy allows), and the audit log
read back per binding (epochs +1 per takeover)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime

from mos_lease import LeaseIdentity
from mos_lease.machine import Close, Rotate, Write
from mos_lease.records import AuditEntry, WriteOutcome
from mos_lease.vocabulary import LeaseState, Outcome
from mos_lease_memory import InMemoryLeaseStore


class Watching(InMemoryLeaseStore):
    """Records each takeover written, and each one of a lease still active at its time."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.takeovers: Counter[LeaseIdentity] = Counter()
        self.preempted: list[tuple[LeaseIdentity, str, str]] = []
        self.on_release_many: Callable[[], object] | None = None

    def release_many(self, items: Sequence[tuple[Close, AuditEntry]]) -> list[WriteOutcome]:
        if self.on_release_many is not None:
            self.on_release_many()
        return super().release_many(items)

    def _write(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        with self._lock:
            before = self._rows.get(write.identity)
            done = super()._write(write, entry)
            if isinstance(write, Rotate) and done.row is not None:
                self.takeovers[write.identity] += 1
                assert before is not None
                if before.state(done.now) is LeaseState.ACTIVE:
                    self.preempted.append((write.identity, before.connector_id,
                                           write.connector_id))
            return done


def active_holder(store: InMemoryLeaseStore, identity: LeaseIdentity, now: datetime
                  ) -> str | None:
    row = store.load(identity).row
    return None if row is None or row.state(now) is not LeaseState.ACTIVE else row.connector_id


def epochs_step_by_one(store: InMemoryLeaseStore, bindings: Sequence[LeaseIdentity]) -> None:
    """Every successful acquire or takeover in the audit log names the epoch after the one
    before it (1 for the first acquire)."""
    for identity in bindings:
        epochs = [r.entry.epoch for r in store.audit(identity, limit=10_000)
                  if r.entry.outcome in (Outcome.ACQUIRED, Outcome.TAKEN_OVER)]
        assert epochs == list(range(1, len(epochs) + 1)), (identity, epochs)
