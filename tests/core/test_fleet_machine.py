"""The fleet's stateful specification (:func:`mos_lease.testing.make_fleet_machine`) on the
in-memory store: members join, leave, crash, rejoin with another weight or member list,
pause, read a stale member set, hand bindings over (as the fleet moves them, and by
handover()) and mint grants, with every invariant checked after each step; and proof that
it catches a fleet with a planted flaw. (It catches a store whose takeover skips the
compare-and-set too, but only after a hundred examples or more, since that needs two
members' turns to race; the race of tests/fleet_race.py shows that flaw at once, in
test_fleet_supervisor.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings

from mos_lease.keep.schedule import Schedule
from mos_lease.machine import grant_refusal
from mos_lease.testing import make_fleet_machine
from mos_lease_memory import MemoryHarness

TestFleetMachine = make_fleet_machine(MemoryHarness).TestCase
TestFleetMachine.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


def _run_flawed() -> None:
    machine = make_fleet_machine(MemoryHarness)
    machine.TestCase.settings = settings(
        max_examples=1000, stateful_step_count=20, deadline=None, database=None,
        derandomize=True,
        phases=[Phase.generate], suppress_health_check=[HealthCheck.too_slow])
    machine.TestCase().runTest()


def _still_holding(real: Callable[..., Any]) -> Callable[..., Any]:
    def handed(self: Schedule, slot: Any, outcome: Any, successor: str, now: float,
               *hold_off: float) -> Any:
        state = slot.state
        changes = real(self, slot, outcome, successor, now, *hold_off)
        if changes:  # released and reported moved, but still counted as held
            slot.state = state
        return changes
    return handed


def _stale_grants_pass(real: Callable[..., Any]) -> Callable[..., Any]:
    def grant_refusal(row: Any, now: Any, **grant: Any) -> Any:
        if row is not None and grant["epoch"] < row.epoch:  # the epoch check skipped
            grant.update(epoch=row.epoch, lease_id=row.lease_id,
                         connector_id=row.connector_id)
        return real(row, now, **grant)
    return grant_refusal


MESSAGES = {  # the invariants each flaw breaks
    "hand-off": "held by two members at once|counts .* as its own",
    "epoch": "valid at once|a grant of an older epoch validated|refused, then valid again",
}


@pytest.mark.parametrize("flaw", list(MESSAGES))
def test_the_specification_catches_a_planted_flaw(monkeypatch: pytest.MonkeyPatch,
                                                  flaw: str) -> None:
    if flaw == "hand-off":
        monkeypatch.setattr(Schedule, "handed", _still_holding(Schedule.handed))
    else:
        monkeypatch.setattr("mos_lease.validation.grant_refusal",
                            _stale_grants_pass(grant_refusal))
        # A hand-off drains the grants minted for the lease before its release, so that
        # none is left to validate under the old epoch; without the drain, an old grant is
        # still alive when the successor takes over, which is where the flaw shows.
        monkeypatch.setattr("mos_lease.keep.schedule.DRAIN", 0.0)
    with pytest.raises(AssertionError, match=MESSAGES[flaw]):
        _run_flawed()
