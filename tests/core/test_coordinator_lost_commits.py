"""A commit whose outcome was lost is reconciled by rereading, never blindly retried,
including a write that lands after reconciliation looked."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, InvalidInput, LeaseHandle, Outcome
from mos_lease.clock import ManualClock
from mos_lease_memory import InMemoryLeaseStore
from tests.helpers import IDENT, OTHER_IDENT, SCOPES, Env, FaultyStore, make_env, row_of


def _faulty_env() -> tuple[Env, FaultyStore, ConnectorLeaseCoordinator]:
    env = make_env()
    faulty = FaultyStore(env.store)
    return env, faulty, ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=env.ids)


@pytest.mark.parametrize("when", ["before", "after"])
def test_lost_commit_is_reconciled_not_blindly_retried(when: str) -> None:
    env, faulty, coordinator = _faulty_env()
    faulty.lose_commit = when
    result = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
    assert result.ok and result.lease is not None
    assert result.lease.epoch == 1
    assert LeaseHandle.of(row_of(env.store)) == result.lease
    assert [r.entry.outcome for r in env.audit()] == [Outcome.ACQUIRED]
    assert coordinator.reconcile(IDENT, env.audit()[0].entry.event_id)
    assert not coordinator.reconcile(IDENT, UUID(int=123456))


def test_lost_takeover_commit_does_not_double_increment() -> None:
    env, faulty, coordinator = _faulty_env()
    assert coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10).ok
    faulty.lose_commit = "after"
    result = coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert result.ok and result.lease is not None and result.lease.epoch == 2
    assert row_of(env.store).epoch == 2
    assert [r.entry.outcome for r in env.audit()] == [Outcome.ACQUIRED, Outcome.TAKEN_OVER]


def test_reconciled_result_says_so() -> None:
    """``LeaseResult.reconciled`` is documented as true when the commit outcome was lost and
    established by rereading; the coordinator never sets it."""
    _, faulty, coordinator = _faulty_env()
    faulty.lose_commit = "after"
    result = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
    assert result.ok
    assert result.reconciled is True
    assert coordinator.acquire(OTHER_IDENT, "conn-a", scopes=SCOPES, ttl=10).reconciled is False


def test_reconcile_checks_its_input() -> None:
    env = make_env()
    with pytest.raises(InvalidInput) as caught:
        env.coordinator.reconcile(IDENT, "not-a-uuid")  # type: ignore[arg-type]
    assert caught.value.field == "event_id"
    with pytest.raises(InvalidInput) as caught:
        env.coordinator.reconcile("x", UUID(int=1))  # type: ignore[arg-type]
    assert caught.value.field == "identity"




def test_an_acquire_that_commits_after_reconciliation_said_no_is_still_ours() -> None:
    """A lost acquire can commit on the server after the coordinator looked for its audit
    row; the lease row then carries our own lease id and the result must say acquired."""
    from mos_lease import CommitOutcomeUnknown
    from mos_lease.machine import write_outcome

    class LateCommit(InMemoryLeaseStore):
        def __init__(self) -> None:
            super().__init__(ManualClock())
            self.pending: tuple[Any, Any] | None = None

        def apply(self, write: Any, entry: Any) -> Any:
            if self.pending is None and entry.event.value == "acquire":
                self.pending = (write, entry)
                raise CommitOutcomeUnknown(entry.event_id, "reply lost")
            return super().apply(write, entry)

        def event_committed(self, event_id: Any) -> bool:
            answer = super().event_committed(event_id)
            if self.pending is not None:  # the in-flight insert lands just after we asked
                write, entry = self.pending
                assert write_outcome(write, None, self.clock.now()) is not None
                super().apply(write, entry)
            return answer

    store = LateCommit()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    result = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
    assert result.ok and result.reconciled
    assert result.lease is not None and result.lease.epoch == 1
    assert [r.entry.outcome for r in store.audit(IDENT)] == [Outcome.ACQUIRED]
