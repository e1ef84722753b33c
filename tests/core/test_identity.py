"""Identity values and input normalization: everything a caller hands in is checked here."""

from __future__ import annotations

import math
import sys
import unicodedata
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mos_lease import InvalidInput, LeaseIdentity
from mos_lease.identity import (
    GRANT_TTL_CAP,
    LEASE_TTL_CAP,
    MAX_EPOCH,
    MAX_ID_LENGTH,
    MAX_SCOPE_LENGTH,
    MAX_SCOPES,
    check_correlation_id,
    check_epoch,
    check_id,
    check_identity,
    normalize_scopes,
    normalize_ttl,
)

GOOD_IDS = ["a", "x" * MAX_ID_LENGTH, "acme-corp_1.2", "Ünïcödé", "agent 7", "\U0001f916bot",
            "tenant/with/slash"]

BAD_ID_STRINGS = [
    "",                          # empty
    "x" * (MAX_ID_LENGTH + 1),   # oversized
    " padded",                   # leading whitespace
    "padded ",                   # trailing whitespace
    "\u3000padded",              # unicode whitespace
    "nul\x00byte",               # C0 control
    "del\x7fchar",               # DEL
    "c1\x85char",                # C1 control (NEL)
    "bidi\u202eoverride",        # RIGHT-TO-LEFT OVERRIDE
    "zero\u200bwidth",           # ZERO WIDTH SPACE
    "iso\u2066late",             # LEFT-TO-RIGHT ISOLATE
    "\ufeffbom",                 # byte order mark
    "lone\ud800surrogate",       # lone high surrogate
    "\udfff",                    # lone low surrogate
    "tab\tinside",
    "new\nline",
]
NON_STR_IDS: list[object] = [None, 5, 1.5, True, b"acme", ["acme"], ("acme",), object()]


@pytest.mark.parametrize("value", GOOD_IDS)
def test_good_ids_are_returned_unchanged(value: str) -> None:
    assert check_id("tenant_id", value) is value


@pytest.mark.parametrize("value", [*BAD_ID_STRINGS, *NON_STR_IDS], ids=repr)
@pytest.mark.parametrize("field", ["tenant_id", "logical_agent_id", "binding_id"])
def test_identity_refuses_bad_ids_naming_the_field(field: str, value: object) -> None:
    fields: dict[str, object] = {"tenant_id": "acme", "logical_agent_id": "agent-1",
                                 "binding_id": "binding-1"}
    fields[field] = value
    with pytest.raises(InvalidInput) as caught:
        LeaseIdentity(**fields)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


def test_id_length_boundary() -> None:
    assert check_id("f", "y" * MAX_ID_LENGTH) == "y" * MAX_ID_LENGTH
    with pytest.raises(InvalidInput, match="at most 128"):
        check_id("f", "y" * (MAX_ID_LENGTH + 1))


def test_non_str_message_names_the_type() -> None:
    with pytest.raises(InvalidInput, match="must be a str, not bytes") as caught:
        check_id("connector_id", b"claude")
    assert caught.value.field == "connector_id"


def test_invalid_input_is_a_value_error_with_field_and_message() -> None:
    with pytest.raises(ValueError) as caught:
        check_id("binding_id", "")
    assert isinstance(caught.value, InvalidInput)
    assert caught.value.field == "binding_id"
    assert caught.value.message == "must not be empty"


def test_every_unicode_format_character_is_refused() -> None:
    """The identity docstring promises that format characters which make two visually equal
    ids differ are refused. Some Cf characters are invisible (SOFT HYPHEN, WORD JOINER) or
    bidi controls (ARABIC LETTER MARK) and are still accepted today."""
    accepted = []
    for code in range(sys.maxunicode + 1):
        ch = chr(code)
        if unicodedata.category(ch) != "Cf":
            continue
        try:
            check_id("tenant_id", f"a{ch}b")
        except InvalidInput:
            continue
        accepted.append(f"U+{code:04X}")
    assert accepted == [], (
        f"{len(accepted)} format characters accepted inside ids, e.g. {accepted[:8]}")


def test_lease_identity_is_a_frozen_value() -> None:
    one = LeaseIdentity("acme", "agent-1", "binding-1")
    assert one == LeaseIdentity("acme", "agent-1", "binding-1")
    assert hash(one) == hash(LeaseIdentity("acme", "agent-1", "binding-1"))
    assert one != LeaseIdentity("acme", "agent-1", "binding-2")
    assert str(one) == "acme/agent-1/binding-1"
    with pytest.raises(AttributeError):
        one.tenant_id = "evil"  # type: ignore[misc]


@pytest.mark.parametrize("value", [None, "acme/agent/binding", ("acme", "a", "b"), {}])
def test_check_identity_refuses_non_identities(value: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        check_identity("identity", value)
    assert caught.value.field == "identity"


def test_correlation_id_none_or_checked() -> None:
    assert check_correlation_id("correlation_id", None) is None
    assert check_correlation_id("correlation_id", "req-1") == "req-1"
    for bad in ["", " x", "a\x00", 7]:
        with pytest.raises(InvalidInput) as caught:
            check_correlation_id("correlation_id", bad)
        assert caught.value.field == "correlation_id"


# --- property: ids -------------------------------------------------------------------------

ANY_CODEPOINT_TEXT = st.lists(st.integers(0, sys.maxunicode).map(chr), max_size=140).map(
    "".join)
ANY_OBJECT = st.one_of(
    ANY_CODEPOINT_TEXT, st.text(), st.integers(), st.floats(), st.booleans(), st.none(),
    st.binary(), st.lists(st.text(), max_size=3), st.tuples(st.text()),
)


def _looks_acceptable(value: str) -> bool:
    return (0 < len(value) <= MAX_ID_LENGTH and value == value.strip()
            and all(unicodedata.category(ch) not in ("Cc", "Cf", "Cs") for ch in value))


@settings(max_examples=400, deadline=None)
@given(ANY_OBJECT)
def test_check_id_accepts_or_raises_invalid_input_only(value: object) -> None:
    try:
        result = check_id("connector_id", value)
    except InvalidInput as bad:
        assert bad.field == "connector_id"
        if isinstance(value, str):
            assert not _looks_acceptable(value)
    else:
        assert result is value
        assert isinstance(value, str)
        assert _looks_acceptable(value)
        value.encode("utf-8")  # storable: never a lone surrogate


# --- scopes --------------------------------------------------------------------------------


def test_scopes_are_deduplicated_and_sorted() -> None:
    assert normalize_scopes("scopes", ["tool:run", "a", "tool:run", "b:x", "a"]) == (
        "a", "b:x", "tool:run")


@pytest.mark.parametrize("collection", [
    ["b", "a"], ("b", "a"), {"a", "b"}, frozenset({"b", "a"}), iter(["b", "a", "b"]),
    {"a": 1, "b": 2}.keys(), (s for s in ["a", "b"]),
], ids=lambda c: type(c).__name__)
def test_scopes_accept_any_iterable_of_str(collection: object) -> None:
    assert normalize_scopes("scopes", collection) == ("a", "b")


def test_empty_scopes_are_allowed() -> None:
    assert normalize_scopes("scopes", []) == ()


@pytest.mark.parametrize("scope", [
    "a", "0day", "tool:shell:run", "a.b-c_d", "x:y.z", "fs:read:v2", "a" * MAX_SCOPE_LENGTH,
])
def test_scope_grammar_accepts(scope: str) -> None:
    assert normalize_scopes("scopes", [scope]) == (scope,)


@pytest.mark.parametrize("scope", [
    "Tool", "tool:Run", "to ol", " tool", "tool ", "", "a::b", ":a", "a:", "-a", "_a", ".a",
    "a:-b", "tool*", "tool:*", "ä", "a\n", "a/b", "a\x00", "\ud800", "a,b",
    "a" * (MAX_SCOPE_LENGTH + 1),
], ids=repr)
def test_scope_grammar_refuses(scope: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        normalize_scopes("scopes", ["ok", scope])
    assert caught.value.field == "scopes"


@pytest.mark.parametrize("value", ["tool:run", b"tool:run", "", b""], ids=repr)
def test_a_bare_string_is_not_a_scope_collection(value: object) -> None:
    with pytest.raises(InvalidInput, match="single string") as caught:
        normalize_scopes("scopes", value)
    assert caught.value.field == "scopes"


@pytest.mark.parametrize("value", [None, 5, 1.5, object(), True], ids=repr)
def test_non_iterable_scopes_are_refused(value: object) -> None:
    with pytest.raises(InvalidInput, match="collection") as caught:
        normalize_scopes("grant_scopes", value)
    assert caught.value.field == "grant_scopes"


@pytest.mark.parametrize("item", [1, None, b"tool", ["tool"], True], ids=repr)
def test_non_str_scope_items_are_refused(item: object) -> None:
    with pytest.raises(InvalidInput, match="scopes must be str") as caught:
        normalize_scopes("scopes", ["tool", item])
    assert caught.value.field == "scopes"


def test_scope_count_limit_counts_distinct_scopes() -> None:
    many = [f"s{i}" for i in range(MAX_SCOPES)]
    assert len(normalize_scopes("scopes", many)) == MAX_SCOPES
    assert normalize_scopes("scopes", ["same"] * (MAX_SCOPES * 3)) == ("same",)
    with pytest.raises(InvalidInput, match="at most 64") as caught:
        normalize_scopes("scopes", [*many, "one-more"])
    assert caught.value.field == "scopes"


SCOPE = st.from_regex(r"[a-z0-9][a-z0-9_.\-]{0,6}(:[a-z0-9][a-z0-9_.\-]{0,6}){0,2}",
                      fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(SCOPE, max_size=20))
def test_normalized_scopes_are_sorted_unique_and_idempotent(scopes: list[str]) -> None:
    norm = normalize_scopes("scopes", scopes)
    assert list(norm) == sorted(set(scopes))
    assert normalize_scopes("scopes", reversed(norm)) == norm


# --- TTLs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    0, 0.0, -0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "10", None, [10],
    301, 300.001, 10**100, timedelta(0), timedelta(seconds=-1),
    timedelta(minutes=5, microseconds=1), timedelta.max, timedelta.min,
    1e-7,  # rounds to a zero timedelta: refused, never silently turned into "no lease"
], ids=repr)
def test_bad_lease_ttls_are_refused(value: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        normalize_ttl("ttl", value, LEASE_TTL_CAP)
    assert caught.value.field == "ttl"


@pytest.mark.parametrize(("value", "expected"), [
    (1e-6, timedelta(microseconds=1)),
    (timedelta(microseconds=1), timedelta(microseconds=1)),
    (0.5, timedelta(milliseconds=500)),
    (1, timedelta(seconds=1)),
    (300, LEASE_TTL_CAP),
    (300.0, LEASE_TTL_CAP),
    (LEASE_TTL_CAP, LEASE_TTL_CAP),
], ids=repr)
def test_good_lease_ttls(value: object, expected: timedelta) -> None:
    got = normalize_ttl("ttl", value, LEASE_TTL_CAP)
    assert got == expected
    assert type(got) is timedelta


def test_grant_cap_is_thirty_seconds() -> None:
    assert normalize_ttl("ttl", 30, GRANT_TTL_CAP) == timedelta(seconds=30)
    for over in [31, 30.000001, timedelta(seconds=30, microseconds=1)]:
        with pytest.raises(InvalidInput, match="at most 30 s"):
            normalize_ttl("ttl", over, GRANT_TTL_CAP)


# --- epochs --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, True, False, MAX_EPOCH + 1, 2**64, 1.0, "1", None],
                         ids=repr)
def test_bad_epochs_are_refused(value: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        check_epoch("expected_epoch", value)
    assert caught.value.field == "expected_epoch"


@pytest.mark.parametrize("value", [1, 2, MAX_EPOCH - 1, MAX_EPOCH])
def test_good_epochs(value: int) -> None:
    assert check_epoch("epoch", value) == value
    assert MAX_EPOCH == 2**63 - 1


def test_lying_str_subclasses_are_reduced_to_plain_strings() -> None:
    """A str subclass that claims equality with everything must not take part in a fencing
    comparison: ids come out of the checks as plain ``str``."""
    from mos_lease.identity import LeaseIdentity, check_id

    class Liar(str):
        def __eq__(self, other: object) -> bool:
            return True

        def __ne__(self, other: object) -> bool:
            return False

        __hash__ = str.__hash__

    checked = check_id("connector_id", Liar("c1"))
    assert type(checked) is str and checked == "c1" and checked != "c2"
    identity = LeaseIdentity(Liar("t"), Liar("a"), Liar("b"))
    assert all(type(v) is str for v in (identity.tenant_id, identity.logical_agent_id,
                                         identity.binding_id))
    assert identity != LeaseIdentity("x", "a", "b")


def test_endless_scope_iterables_and_huge_int_ttls_are_refused() -> None:
    import itertools

    from mos_lease.identity import LEASE_TTL_CAP, normalize_scopes, normalize_ttl

    with pytest.raises(InvalidInput, match="scope items"):
        normalize_scopes("scopes", itertools.repeat("tool:read"))
    for huge in (10**400, -(10**400)):
        with pytest.raises(InvalidInput):
            normalize_ttl("ttl", huge, LEASE_TTL_CAP)
