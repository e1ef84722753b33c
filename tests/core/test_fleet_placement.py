"""The fleet's placement (:mod:`mos_lease.fleet.placement`): every member computes the same
preferred member for each binding whatever the input order, no member is preferred for more
than its cap, weights are respected, and a join or a leave moves few bindings (measured here
as a bound the property asserts)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mos_lease import InvalidInput, LeaseIdentity
from mos_lease.fleet.placement import (
    PLACEMENT_SLACK,
    Placer,
    binding_digest,
    caps,
    member_digest,
    place,
)

names = st.text(st.characters(codec="utf-8", categories=("L", "N")), min_size=1, max_size=6)
member_sets = st.sets(names, min_size=1, max_size=8)
identities = st.builds(LeaseIdentity, st.sampled_from(["t1", "t2"]),
                       st.text("abcdef", min_size=1, max_size=4), st.sampled_from(["b", "c"]))
binding_lists = st.lists(identities, max_size=120)


def _bindings(count: int, salt: str = "") -> list[LeaseIdentity]:
    return [LeaseIdentity(f"t{i % 20}", f"agent-{i}{salt}", "b") for i in range(count)]


@settings(max_examples=150)
@given(member_sets, binding_lists, st.randoms(use_true_random=False))
def test_same_answer_for_any_order(members: set[str], bindings: list[LeaseIdentity],
                                   rnd: object) -> None:
    names_in_order = sorted(members)
    shuffled_members = list(names_in_order)
    shuffled_bindings = list(bindings) + list(bindings)  # duplicates count once
    rnd.shuffle(shuffled_members)  # type: ignore[attr-defined]
    rnd.shuffle(shuffled_bindings)  # type: ignore[attr-defined]
    one = place(names_in_order, bindings)
    other = place(shuffled_members, shuffled_bindings)
    assert one.assignment() == other.assignment()
    assert set(one.assignment()) == set(bindings)


weight_maps = st.dictionaries(names, st.sampled_from([0.5, 1, 2, 3.5]), min_size=1, max_size=5)


@settings(max_examples=100)
@given(binding_lists, st.lists(member_sets | weight_maps, min_size=1, max_size=6))
def test_a_placer_kept_across_member_sets_answers_as_place(
        bindings: list[LeaseIdentity], member_sets_seen: list[set[str] | dict[str, float]]
        ) -> None:
    # A fleet member keeps one Placer while members join, leave and change weight: each of
    # its answers must be place()'s, whatever columns it kept from the sets before.
    placer = Placer(bindings)
    for members in member_sets_seen:
        assert placer.place(members).assignment() == place(members, bindings).assignment()


def test_a_placer_scores_again_past_its_column_cache() -> None:
    bindings = _bindings(50)
    placer = Placer(bindings)
    many = [f"m{k}" for k in range(Placer.COLUMNS + 10)]
    for first in range(0, len(many), 7):
        members = many[first:first + 7]
        assert placer.place(members).assignment() == place(members, bindings).assignment()
    assert placer.place(many).assignment() == place(many, bindings).assignment()


def test_a_placer_refuses_bad_members_like_place() -> None:
    with pytest.raises(InvalidInput) as caught:
        Placer(_bindings(3)).place({"a": 0})
    assert caught.value.field == "members['a']"


@settings(max_examples=150)
@given(st.dictionaries(names, st.sampled_from([0.5, 1, 1.0, 2, 3.5]), min_size=1, max_size=6),
       binding_lists)
def test_no_member_is_preferred_beyond_its_cap(weights: dict[str, float],
                                               bindings: list[LeaseIdentity]) -> None:
    placement = place(weights, bindings)
    count = len(set(bindings))
    total = sum(weights.values())
    shares = Counter(placement.assignment().values())
    for name, weight in weights.items():
        cap = math.ceil(PLACEMENT_SLACK * count * weight / total)
        assert placement.caps[name] == cap
        assert shares[name] <= cap
        assert placement.share(name) == {b for b, m in placement.assignment().items()
                                         if m == name}
    assert sum(caps(weights, count).values()) >= count


def _overflow_bound(count: int) -> float:
    """How many bindings a change of the member set may move between members it did not
    change, measured, not derived: plain rendezvous moves none; the cap makes a binding go
    to its next choice when its first is full, and a change of the member set changes
    which first choices are full. Over 1,500 random joins and leaves (1 to 7 members, 3 to
    1,000 bindings) the most was 2 of 3, 4 of 10, 5 of 30, 7 of 100, 11 of 300, 10 of
    1,000; at 10,000 bindings none (test below). Asserted: ``2 x sqrt(count) + 1``."""
    return 2 * math.sqrt(count) + 1


@settings(max_examples=80, deadline=None)
@given(st.sets(names, min_size=1, max_size=6), names, st.sampled_from([3, 10, 40, 300]),
       st.text("xyz", max_size=3))
def test_a_join_moves_its_share_and_few_others(members: set[str], newcomer: str, count: int,
                                              salt: str) -> None:
    if newcomer in members:
        return
    bindings = _bindings(count, salt)
    before = place(members, bindings).assignment()
    after = place(members | {newcomer}, bindings).assignment()
    moved = [b for b in bindings if before[b] != after[b]]
    others = [b for b in moved if after[b] != newcomer]
    assert len(others) <= _overflow_bound(count)
    assert len(moved) <= PLACEMENT_SLACK * count / (len(members) + 1) + _overflow_bound(count)


@settings(max_examples=80, deadline=None)
@given(st.sets(names, min_size=2, max_size=7), st.sampled_from([3, 10, 40, 300]),
       st.text("xyz", max_size=3), st.data())
def test_a_leave_moves_the_leavers_bindings_and_few_others(
        members: set[str], count: int, salt: str, data: st.DataObject) -> None:
    leaver = data.draw(st.sampled_from(sorted(members)))
    bindings = _bindings(count, salt)
    before = place(members, bindings).assignment()
    after = place(members - {leaver}, bindings).assignment()
    assert all(after[b] != leaver for b in bindings)
    others = [b for b in bindings if before[b] != after[b] and before[b] != leaver]
    assert len(others) <= _overflow_bound(count)


@pytest.mark.parametrize("members", [1, 2, 3, 5, 8, 16])
def test_at_10000_bindings_a_join_and_a_leave_move_only_the_changed_member_s(
        members: int) -> None:
    bindings = _bindings(10_000)
    names_before = [f"m{i}" for i in range(members)]
    before = place(names_before, bindings).assignment()
    after = place([*names_before, "new"], bindings).assignment()
    moved = [b for b in bindings if before[b] != after[b]]
    assert all(after[b] == "new" for b in moved)
    assert len(moved) <= PLACEMENT_SLACK * 10_000 / (members + 1)
    # And back: the newcomer leaving returns exactly its bindings where they were.
    assert place(names_before, bindings).assignment() == before


def test_weights_are_respected() -> None:
    bindings = _bindings(10_000)
    weights = {"small": 1, "middle": 2, "large": 5}
    shares = Counter(place(weights, bindings).assignment().values())
    total = sum(weights.values())
    for name, weight in weights.items():
        fair = 10_000 * weight / total
        assert 0.9 * fair <= shares[name] <= PLACEMENT_SLACK * fair + 1


def test_equal_weights_balance_within_the_slack() -> None:
    shares = Counter(place(["a", "b", "c"], _bindings(10_000)).assignment().values())
    assert max(shares.values()) <= math.ceil(PLACEMENT_SLACK * 10_000 / 3)
    assert min(shares.values()) >= 0.9 * 10_000 / 3


def test_the_answer_is_fixed_across_processes() -> None:
    """Stable hashing, never Python's salted ``hash()``: known digests and one known
    placement, so a change of the encoding or the mixing is a visible break."""
    assert member_digest("gw-1") == member_digest("gw-1")
    assert binding_digest(LeaseIdentity("t", "a", "b")) == 0x069D4B892AE3EA18
    assert member_digest("gw-1") == 0x68972551A6E5EB3C
    placement = place(["gw-1", "gw-2", "gw-3"], _bindings(6))
    assert [placement.preferred(b) for b in _bindings(6)] == [
        "gw-1", "gw-2", "gw-2", "gw-1", "gw-1", "gw-2"]


def test_lookups() -> None:
    bindings = _bindings(10)
    placement = place(["a", "b"], bindings)
    for binding in bindings:
        member = placement.preferred(binding)
        assert member in ("a", "b")
        assert placement.is_preferred(binding, member)
        assert binding in placement.share(member)
    unknown = LeaseIdentity("x", "y", "z")
    assert placement.preferred(unknown) is None
    assert not placement.is_preferred(unknown, "a")
    assert placement.share("nobody") == frozenset()
    assert placement.bindings == 10
    empty = place([], bindings)
    assert empty.preferred(bindings[0]) is None
    assert empty.bindings == 0


@pytest.mark.parametrize(("members", "field", "message"), [
    ("abc", "members", "not a single string"),
    (42, "members", "not int"),
    (["a", ""], "members[]", "must not be empty"),
    (["a", " b"], "members[]", "whitespace"),
    ({"a": 0}, "members['a']", "positive"),
    ({"a": -1.0}, "members['a']", "positive"),
    ({"a": math.inf}, "members['a']", "finite"),
    ({"a": math.nan}, "members['a']", "finite"),
    ({"a": True}, "members['a']", "not bool"),
    ({"a": "1"}, "members['a']", "not str"),
    ({"a": 2e6}, "members['a']", "at most"),
    (["a", "a"], "members", "distinct"),
])
def test_bad_members_are_refused(members: object, field: str, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        place(members, _bindings(3))
    assert caught.value.field == field
    assert message in caught.value.message


def test_bad_bindings_are_refused() -> None:
    with pytest.raises(InvalidInput) as caught:
        place(["a"], ["t/a/b"])  # type: ignore[list-item]
    assert caught.value.field == "bindings[]"
