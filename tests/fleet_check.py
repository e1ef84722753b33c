"""Checks of a fleet run, shared by the fleet tests: a store that records every takeover
with the row it replaced (a takeover of an active lease is a preemption the fleet must never
ask for, whatever the policy allows), the audit log read back per binding (epochs +1 per
takeover), each connector's share of the bindings, read and waited for (any store), and a
rig of members run in this process."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from datetime import datetime

from mos_lease import ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.machine import Close, Rotate, Write
from mos_lease.records import AuditEntry, WriteOutcome
from mos_lease.supervisor import Supervisor
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


def shares(reader: ConnectorLeaseCoordinator, bindings: list[LeaseIdentity]
           ) -> Counter[str | None]:
    """How many of ``bindings`` each connector holds an active lease of (``None``: none)."""
    views = reader.current_holders(bindings)
    return Counter(None if v is None or v.state is not LeaseState.ACTIVE
                   else v.connector_id for v in views)


def wait_for_shares(reader: ConnectorLeaseCoordinator, bindings: list[LeaseIdentity],
                    check: Callable[[Counter[str | None]], bool], timeout: float
                    ) -> Counter[str | None]:
    """The first :func:`shares` that ``check`` accepts, read every 50 ms for ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        found = shares(reader, bindings)
        if check(found):
            return found
        assert time.monotonic() < end, f"timed out; shares {found}"
        time.sleep(0.05)


class MemberRig:
    """Members of one fleet run in this process over the same ``bindings``, each a
    :class:`Supervisor` closed with ``stack``, and their shares read by ``reader``."""

    def __init__(self, reader: ConnectorLeaseCoordinator, bindings: list[LeaseIdentity],
                 ttl: float, stack: ExitStack) -> None:
        self.reader, self.bindings, self.ttl, self.stack = reader, bindings, ttl, stack
        self.running: dict[str, Supervisor] = {}

    def join(self, name: str, supervisor: Supervisor) -> Supervisor:
        """Run ``supervisor`` as member ``name``: every binding added, closed at the end."""
        self.stack.callback(supervisor.close)
        for identity in self.bindings:
            supervisor.add(identity, name, scopes=["tool:run"], ttl=self.ttl)
        self.running[name] = supervisor
        return supervisor

    def shares(self) -> Counter[str | None]:
        return shares(self.reader, self.bindings)

    def wait_for(self, check: Callable[[Counter[str | None]], bool], timeout: float
                 ) -> Counter[str | None]:
        return wait_for_shares(self.reader, self.bindings, check, timeout)
