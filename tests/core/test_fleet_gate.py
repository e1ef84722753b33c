"""The fleet's campaign gate (:mod:`mos_lease.fleet.gate`): a member campaigns at once only
for unheld bindings preferred to it, for other unheld ones after the grace period, never for
a binding with an active lease; with equal views exactly one member campaigns at once for
each unheld binding; with disagreeing views members driving real leases (memory store,
preemption allowed by the policy) never take over an active lease and never leave a binding
unheld past the grace period."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mos_lease import InvalidInput, LeaseIdentity
from mos_lease.clock import ManualClock
from mos_lease.fleet.gate import (
    Gate,
    GateReason,
    Held,
    Observed,
    Unheld,
    gates,
    hand_offs,
    next_look,
)
from mos_lease.fleet.placement import place
from mos_lease.vocabulary import LeaseState
from mos_lease_memory import InMemoryLeaseStore
from tests.fleet_sim import SimMember

T0 = datetime(2026, 1, 1, tzinfo=UTC)
GRACE = timedelta(seconds=5)
BINDINGS = [LeaseIdentity("t", f"agent-{i}", "b") for i in range(12)]
MEMBERS = ["m1", "m2", "m3"]


def test_each_reason() -> None:
    placement = place(MEMBERS, BINDINGS)
    mine = next(b for b in BINDINGS if placement.is_preferred(b, "m1"))
    other = next(b for b in BINDINGS if not placement.is_preferred(b, "m1"))
    expiry = T0 + timedelta(seconds=3)
    observed: dict[LeaseIdentity, Observed] = {mine: Unheld(T0)}
    assert gates(placement, "m1", observed, T0, GRACE) == {
        mine: Gate(True, GateReason.PREFERRED, None)}
    now = T0 + timedelta(seconds=1)
    assert gates(placement, "m1", {other: Unheld(T0)}, now, GRACE)[other] == Gate(
        False, GateReason.IN_GRACE, T0 + GRACE)
    assert gates(placement, "m1", {other: Unheld(T0)}, T0 + GRACE, 5)[other] == Gate(
        True, GateReason.GRACE_ELAPSED, None)
    for holder in ("m2", "m3", None, "outsider"):
        # Active: never campaigned for, preferred to me or not, whoever holds it.
        for binding in (mine, other):
            assert gates(placement, "m1", {binding: Held(holder, expiry)}, now, GRACE)[
                binding] == Gate(False, GateReason.HELD, expiry)
    assert gates(placement, "m1", {other: Held("m1", expiry)}, now, GRACE)[other] == Gate(
        False, GateReason.MINE, None)
    decided = gates(placement, "m1", {other: Unheld(T0), mine: Held("m2", expiry)}, now,
                    GRACE)
    assert next_look(decided) == expiry
    assert next_look({}) is None


def test_hand_offs_are_the_held_bindings_preferred_elsewhere() -> None:
    placement = place(MEMBERS, BINDINGS)
    moves = hand_offs(placement, "m1", [*BINDINGS, LeaseIdentity("x", "y", "z")])
    assert moves == {b: placement.preferred(b) for b in BINDINGS
                     if not placement.is_preferred(b, "m1")}
    # A member missing from the placement (its own lease lapsed) hands everything off.
    assert set(hand_offs(place(["m2", "m3"], BINDINGS), "m1", BINDINGS)) == set(BINDINGS)


@pytest.mark.parametrize(("me", "grace", "now", "observed", "field"), [
    ("", GRACE, T0, {}, "me"),
    ("m1", 0, T0, {}, "grace"),
    ("m1", -1.0, T0, {}, "grace"),
    ("m1", float("inf"), T0, {}, "grace"),
    ("m1", True, T0, {}, "grace"),
    ("m1", "5", T0, {}, "grace"),
    ("m1", GRACE, datetime(2026, 1, 1), {}, "now"),  # naive: the bad input
    ("m1", GRACE, T0, {BINDINGS[0]: T0}, "observed"),
])
def test_bad_input_is_refused(me: str, grace: object, now: datetime, observed: object,
                              field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        gates(place(MEMBERS, BINDINGS), me, observed, now, grace)  # type: ignore[arg-type]
    assert caught.value.field == field


observations = st.one_of(
    st.builds(Unheld, st.integers(-20, 20).map(lambda s: T0 + timedelta(seconds=s))),
    st.builds(Held, st.sampled_from([*MEMBERS, "m4", None]),
              st.integers(1, 20).map(lambda s: T0 + timedelta(seconds=s))))


@settings(max_examples=200)
@given(st.lists(observations, min_size=len(BINDINGS), max_size=len(BINDINGS)),
       st.sets(st.sampled_from([*MEMBERS, "m4", "m5"]), min_size=1))
def test_with_equal_views_exactly_one_member_campaigns_at_once(
        seen: list[Observed], members: set[str]) -> None:
    placement = place(members, BINDINGS)
    observed = dict(zip(BINDINGS, seen, strict=True))
    decided = {m: gates(placement, m, observed, T0, GRACE) for m in members}
    for binding, what in observed.items():
        campaigning = [m for m in members if decided[m][binding].campaign]
        if isinstance(what, Held):
            assert campaigning == []
        elif what.since + GRACE > T0:
            assert campaigning == [placement.preferred(binding)]
        else:
            assert sorted(campaigning) == sorted(members)  # the grace is over: anyone


@settings(max_examples=200)
@given(st.lists(observations, min_size=len(BINDINGS), max_size=len(BINDINGS)),
       st.lists(st.sets(st.sampled_from([*MEMBERS, "m4"]), min_size=1), min_size=2,
                max_size=3))
def test_with_any_views_no_member_campaigns_for_an_active_lease(
        seen: list[Observed], views: list[set[str]]) -> None:
    observed = dict(zip(BINDINGS, seen, strict=True))
    for view in views:
        placement = place(view, BINDINGS)
        for me in view:
            for binding, decision in gates(placement, me, observed, T0, GRACE).items():
                assert not (decision.campaign and isinstance(observed[binding], Held))


steps = st.lists(st.one_of(
    st.tuples(st.just("turn"), st.sampled_from(MEMBERS)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 1, 3, 7])),
    st.tuples(st.just("crash"), st.sampled_from(MEMBERS))), max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.sampled_from(MEMBERS)), min_size=3, max_size=3), steps)
def test_disagreeing_members_never_preempt_and_never_leave_a_binding_unheld(
        views: list[set[str]], program: list[tuple[str, object]]) -> None:
    clock = ManualClock()
    store = InMemoryLeaseStore(clock)
    members = {name: SimMember(name, view, store, clock.now, BINDINGS, GRACE)
               for name, view in zip(MEMBERS, views, strict=True)}
    live = set(MEMBERS)
    for kind, arg in program:
        if kind == "turn" and arg in live:
            members[str(arg)].turn(ttl=4)
        elif kind == "advance":
            clock.advance(float(arg))  # type: ignore[arg-type]
        elif kind == "crash":
            live.discard(str(arg))
        # At most one lease of a binding is valid at store time: the handles members hold
        # that still match the row's epoch and lease id while it is active.
        now = clock.now()
        for binding in BINDINGS:
            row = store.load(binding).row
            valid = [m for m in members.values() if binding in m.held
                     and row is not None and row.state(now) is LeaseState.ACTIVE
                     and m.held[binding].lease_id == row.lease_id]
            assert len(valid) <= 1
    if not live:
        return
    # Liveness: once every lease has expired, two turns of each live member a grace period
    # apart (the first to see what is unheld) leave every binding held by a live member.
    clock.advance(4)
    for name in sorted(live):
        members[name].turn(ttl=60)
    clock.advance(GRACE.total_seconds())
    for name in sorted(live):
        members[name].turn(ttl=60)
    now = clock.now()
    for binding in BINDINGS:
        row = store.load(binding).row
        assert row is not None and row.state(now) is LeaseState.ACTIVE
        assert row.connector_id in live
