"""The fencing token's text form: round trips, strict parsing, tamper evidence."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
from datetime import UTC, datetime, timedelta, timezone
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mos_lease import ConnectorExecutionContext, InvalidInput, LeaseIdentity
from mos_lease.identity import MAX_EPOCH, MAX_ID_LENGTH
from mos_lease.token import MAX_TOKEN_LENGTH, FencingToken, format_token, parse_token

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
LEASE = UUID("12345678-1234-5678-1234-567812345678")
EXPIRES = datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
TOKEN = FencingToken(LeaseIdentity("acme", "agent-1", "binding-1"), "conn-a", LEASE, 7, EXPIRES)

# --- strategies ---------------------------------------------------------------------------

ids = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Cf", "Zl", "Zp")),
    min_size=1, max_size=MAX_ID_LENGTH,
).filter(lambda s: s == s.strip())
offsets = st.builds(timezone, st.timedeltas(min_value=timedelta(hours=-23),
                                            max_value=timedelta(hours=23)))
instants = st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1),
                        timezones=offsets)
tokens = st.builds(
    FencingToken,
    identity=st.builds(LeaseIdentity, ids, ids, ids),
    connector_id=ids,
    lease_id=st.uuids(),
    epoch=st.integers(1, MAX_EPOCH),
    expires_at=instants,
)
B64_AND_MORE = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.=+/ \n\x00é"


@st.composite
def mutations(draw: st.DrawFn, text: str) -> str:
    """One random edit: replace, insert, delete or swap a character, or truncate."""
    kind = draw(st.sampled_from(["replace", "insert", "delete", "swap", "truncate"]))
    i = draw(st.integers(0, len(text) - 1))
    char = draw(st.sampled_from(B64_AND_MORE))
    if kind == "replace":
        return text[:i] + char + text[i + 1:]
    if kind == "insert":
        return text[:i] + char + text[i:]
    if kind == "delete":
        return text[:i] + text[i + 1:]
    if kind == "swap" and i + 1 < len(text):
        return text[:i] + text[i + 1] + text[i] + text[i + 2:]
    return text[:i]


# --- helpers to build raw (possibly invalid) payloads -------------------------------------


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def field(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack(">H", len(raw)) + raw


def payload(*, tenant: str | bytes = "acme", agent: str | bytes = "agent-1",
            binding: str | bytes = "binding-1", connector: str | bytes = "conn-a",
            lease: bytes = LEASE.bytes, epoch: int = 7, micros: int = 0,
            tail: bytes = b"") -> bytes:
    return (field(tenant) + field(agent) + field(binding) + field(connector) + lease
            + struct.pack(">Qq", epoch, micros) + tail)


def unsigned(raw: bytes) -> str:
    return "mlf1." + b64(raw)


def signed(raw: bytes, key: bytes = KEY) -> str:
    head = unsigned(raw)
    return head + "." + b64(hmac.new(key, head.encode(), hashlib.sha256).digest())


def rejected(text: object, **kw: object) -> InvalidInput:
    with pytest.raises(InvalidInput) as caught:
        parse_token(text, **kw)  # type: ignore[arg-type]
    assert caught.value.field == "token"
    return caught.value


# --- round trips --------------------------------------------------------------------------


@given(tokens)
def test_round_trip_unsigned(token: FencingToken) -> None:
    text = format_token(token)
    assert text.startswith("mlf1.")
    assert text.count(".") == 1
    assert parse_token(text) == token
    assert format_token(parse_token(text)) == text


@given(tokens)
def test_round_trip_signed(token: FencingToken) -> None:
    text = format_token(token, key=KEY)
    assert text.count(".") == 2
    assert parse_token(text, key=KEY) == token
    assert parse_token(text, key=[OTHER_KEY, KEY]) == token  # rotation: any listed key
    assert format_token(parse_token(text, key=KEY), key=KEY) == text


def test_known_encoding_is_stable() -> None:
    # A fixed vector: the text form is a wire format, so it must never change by accident.
    assert format_token(TOKEN) == unsigned(payload(micros=1893499200123456))
    assert format_token(TOKEN, key=KEY) == signed(payload(micros=1893499200123456))


def test_from_context_matches_token() -> None:
    context = ConnectorExecutionContext(TOKEN.identity, "conn-a", LEASE, 7, ("tool:run",),
                                        EXPIRES.astimezone(timezone(timedelta(hours=5))), "c1")
    assert FencingToken.from_context(context) == TOKEN
    assert format_token(context) == format_token(TOKEN)
    assert parse_token(format_token(context, key=KEY), key=KEY).expires_at == EXPIRES


def test_compact() -> None:
    assert len(format_token(TOKEN)) < 100
    assert len(format_token(TOKEN, key=KEY)) < 150


# --- mutations ----------------------------------------------------------------------------


@settings(max_examples=300)
@given(st.data(), tokens)
def test_mutated_unsigned_is_rejected_or_a_different_token(data: st.DataObject,
                                                            token: FencingToken) -> None:
    text = format_token(token)
    mutated = data.draw(mutations(text))
    if mutated == text:
        return
    try:
        other = parse_token(mutated)
    except InvalidInput as bad:
        assert bad.field == "token"
        return
    # Unsigned tokens carry no proof, so an edit can land on another valid token; but never
    # on the same one (one token has one text) and only on a canonical text.
    assert other != token
    assert format_token(other) == mutated


@settings(max_examples=300)
@given(st.data(), tokens)
def test_mutated_signed_is_always_rejected(data: st.DataObject, token: FencingToken) -> None:
    text = format_token(token, key=KEY)
    mutated = data.draw(mutations(text))
    if mutated == text:
        return
    rejected(mutated, key=KEY)
    # Without a key only unsigned tokens parse, so the only edit that gets through is
    # cutting the whole signature off: which is why a boundary that relies on signatures
    # must be given the key (and then refuses unsigned tokens, as above).
    try:
        stripped = parse_token(mutated)
    except InvalidInput:
        return
    assert mutated == format_token(token) and stripped == token


def test_tampered_epoch_is_rejected_only_when_signed() -> None:
    raised = payload(epoch=8, micros=1893499200123456)
    original_mac = signed(payload(micros=1893499200123456)).rsplit(".", 1)[1]
    forged = unsigned(raised) + "." + original_mac
    assert "signature does not match" in str(rejected(forged, key=KEY))
    # The same edit on an unsigned token is a valid token: the reason to sign.
    assert parse_token(unsigned(raised)).epoch == 8


def test_signature_by_another_key_is_rejected() -> None:
    text = format_token(TOKEN, key=OTHER_KEY)
    assert "signature does not match" in str(rejected(text, key=KEY))


# --- strict parsing -----------------------------------------------------------------------

GOOD = unsigned(payload())


@pytest.mark.parametrize(("text", "message"), [
    ("", "not a mlf1"),
    ("mlf1.", "not a mlf1"),
    ("mlf1", "not a mlf1"),
    ("MLF1." + GOOD[5:], "not a mlf1"),
    ("mlf2." + GOOD[5:], "unsupported token version"),
    ("mlf10." + GOOD[5:], "unsupported token version"),
    (GOOD + "\n", "not a mlf1"),
    (" " + GOOD, "not a mlf1"),
    (GOOD + " ", "not a mlf1"),
    (GOOD + "=", "not a mlf1"),
    (GOOD + ".", "not a mlf1"),
    (GOOD.replace("-", "+").replace("_", "/") + "+", "not a mlf1"),
    ("mlf1.A", "not valid base64url"),
    (GOOD[:-1], "payload"),
    ("mlf1." + "A" * (MAX_TOKEN_LENGTH - 5), "tenant_id"),
    ("mlf1." + "A" * MAX_TOKEN_LENGTH, "at most"),
    (unsigned(payload(tail=b"\x00")), "after the last field"),
    (unsigned(payload()[:-1]), "ends inside"),
    (unsigned(payload(epoch=0)), "epoch"),
    (unsigned(payload(epoch=MAX_EPOCH + 1)), "epoch"),
    (unsigned(payload(epoch=2**64 - 1)), "epoch"),
    (unsigned(payload(micros=2**63 - 1)), "out of range"),
    (unsigned(payload(micros=-(2**63))), "out of range"),
    (unsigned(payload(tenant="")), "tenant_id"),
    (unsigned(payload(agent="a\x00b")), "logical_agent_id"),
    (unsigned(payload(binding=" b")), "binding_id"),
    (unsigned(payload(connector="x" * (MAX_ID_LENGTH + 1))), "connector_id"),
    (unsigned(payload(tenant=b"\xff\xfe")), "UTF-8"),
    (unsigned(payload(tenant=b"\xed\xa0\x80")), "UTF-8"),  # an encoded lone surrogate
    (unsigned(payload(lease=b"\x00" * 15)), "payload"),
])
def test_malformed_is_rejected(text: str, message: str) -> None:
    assert message in str(rejected(text))


def test_non_canonical_base64_is_rejected() -> None:
    # "AB" and "AC" both decode to b"\x00" (the last character's spare bits differ):
    # accepting both would give one token two texts.
    raw = payload(connector="conn-ab")
    text = unsigned(raw)
    assert len(b64(raw)) % 4 != 0, "the fixture payload must leave spare bits"
    last = text[-1]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    twin = text[:-1] + alphabet[alphabet.index(last) + 1]
    assert base64.urlsafe_b64decode(twin[5:] + "=" * (-len(twin[5:]) % 4)) == raw
    assert "canonical" in str(rejected(twin))


def test_signature_rules() -> None:
    text = format_token(TOKEN, key=KEY)
    assert "needed to verify" in str(rejected(text))
    assert "signature is required" in str(rejected(format_token(TOKEN), key=KEY))
    head = text.rsplit(".", 1)[0]
    assert "wrong length" in str(rejected(head + "." + b64(b"\x00" * 16), key=KEY))
    assert "wrong length" in str(rejected(head + "." + b64(b"\x00" * 33), key=KEY))


@pytest.mark.parametrize("key", [b"short", "k" * 32, [], [KEY, b"x"], 42])
def test_bad_keys_are_refused(key: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_token(format_token(TOKEN, key=KEY), key=key)  # type: ignore[arg-type]
    assert caught.value.field == "key"


def test_format_refuses_bad_key_and_source() -> None:
    with pytest.raises(InvalidInput, match="key"):
        format_token(TOKEN, key=b"short")
    with pytest.raises(InvalidInput, match="context"):
        format_token("mlf1.abc")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, b"mlf1.AAAA", 12, ["mlf1."]])
def test_non_text_is_rejected(value: object) -> None:
    assert "must be a str" in str(rejected(value))


@pytest.mark.parametrize(("kwargs", "field_name"), [
    ({"identity": ("acme", "a", "b")}, "identity"),
    ({"connector_id": ""}, "connector_id"),
    ({"lease_id": str(LEASE)}, "lease_id"),
    ({"epoch": 0}, "epoch"),
    ({"epoch": True}, "epoch"),
    ({"epoch": MAX_EPOCH + 1}, "epoch"),
    ({"expires_at": datetime(2030, 1, 1)}, "expires_at"),
    ({"expires_at": "2030-01-01T00:00:00Z"}, "expires_at"),
    ({"expires_at": datetime.min.replace(tzinfo=timezone(timedelta(hours=5)))}, "expires_at"),
])
def test_token_fields_are_validated(kwargs: dict[str, object], field_name: str) -> None:
    fields: dict[str, object] = {"identity": TOKEN.identity, "connector_id": "c",
                                 "lease_id": LEASE, "epoch": 1, "expires_at": EXPIRES}
    fields.update(kwargs)
    with pytest.raises(InvalidInput) as caught:
        FencingToken(**fields)  # type: ignore[arg-type]
    assert caught.value.field == field_name


def test_expiry_is_normalized_to_utc() -> None:
    local = EXPIRES.astimezone(timezone(timedelta(hours=-7)))
    token = FencingToken(TOKEN.identity, "conn-a", LEASE, 7, local)
    assert token.expires_at.utcoffset() == timedelta(0)
    assert token == TOKEN


class _NeverLess(int):
    """An epoch whose comparisons lie: never less than (or equal to) anything."""

    def __lt__(self, other: object) -> bool:
        return False

    def __le__(self, other: object) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = int.__hash__


class _AlwaysLater(datetime):
    def __gt__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True


def test_a_hand_built_token_keeps_only_plain_checked_values() -> None:
    # A subclass with lying comparisons must not reach a guard: the token keeps the plain
    # value its checks returned, and a guard that has seen epoch 5 refuses this epoch 1.
    from mos_lease_memory.fencing import InMemoryResourceGuard

    identity = LeaseIdentity("t", "a", "b")
    later = datetime(2100, 1, 1, tzinfo=UTC)
    guard = InMemoryResourceGuard()
    assert guard.admit("r", FencingToken(identity, "c", UUID(int=5), 5, later)).ok
    liar = FencingToken(identity, "c", UUID(int=1), _NeverLess(1),
                        _AlwaysLater(2000, 1, 1, tzinfo=UTC))
    assert type(liar.epoch) is int and type(liar.expires_at) is datetime
    assert liar.expires_at == datetime(2000, 1, 1, tzinfo=UTC)
    decision = guard.admit("r", liar)
    assert not decision.ok and decision.reason is not None
    assert decision.reason.value == "stale_epoch"
