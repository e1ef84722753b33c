"""specs/token.md, its vectors and the code agree, in both directions.

* The library formats every valid vector's fields to exactly its text and parses the text to
  exactly those fields; it refuses every invalid vector with the message the vector names;
  the in-memory guard decides every guard vector as written.
* The committed vectors are what ``specs/make_token_vectors.py`` produces today.
* Every refusal the specification lists has a vector, and every vector's refusal and message
  are the specification's.
* A second decoder, written here from the specification alone (standard library only,
  nothing from ``mos_lease``), agrees with every vector: the specification is enough to
  build a verifier from.
"""

from __future__ import annotations

import base64
import hmac
import importlib.util
import json
import re
import struct
import unicodedata
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast
from uuid import UUID

import pytest

from mos_lease import InvalidInput, LeaseIdentity
from mos_lease.fencing import FenceReason
from mos_lease.identity import check_id
from mos_lease.token import FencingToken, format_token, parse_token
from mos_lease_memory.fencing import InMemoryResourceGuard

SPECS = Path(__file__).resolve().parents[2] / "specs"
SPEC_TEXT = (SPECS / "token.md").read_text(encoding="utf-8")
VECTORS_TEXT = (SPECS / "token_vectors.json").read_text(encoding="utf-8")
VECTORS: dict[str, Any] = json.loads(VECTORS_TEXT)
VALID: list[dict[str, Any]] = VECTORS["valid"]
INVALID: list[dict[str, Any]] = VECTORS["invalid"]
GUARD: list[dict[str, Any]] = VECTORS["guard"]


def by_id(vectors: list[dict[str, Any]]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("vector", vectors, ids=[v["id"] for v in vectors])


def keys_of(vector: dict[str, Any]) -> bytes | list[bytes] | None:
    """The verifier's keys as ``parse_token`` takes them: both spellings get exercised."""
    keys = [bytes.fromhex(k) for k in vector["keys"]]
    if not keys:
        return None
    return keys[0] if len(keys) == 1 else keys


def expected_token(fields: dict[str, str]) -> FencingToken:
    return FencingToken(
        LeaseIdentity(fields["tenant_id"], fields["logical_agent_id"], fields["binding_id"]),
        fields["connector_id"], UUID(fields["lease_id"]), int(fields["epoch"]),
        datetime.fromisoformat(fields["expires_at"]),
    )


# --- the generator ------------------------------------------------------------------------


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("make_token_vectors",
                                                  SPECS / "make_token_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_vectors_are_what_the_generator_writes() -> None:
    render = cast(Callable[[], str], load_generator().render)
    assert render() == VECTORS_TEXT, (
        "specs/token_vectors.json is stale: run python specs/make_token_vectors.py and "
        "review the change (a changed vector is a changed wire format)")


# --- the library against the vectors ------------------------------------------------------


@by_id(VALID)
def test_valid_vector_formats_to_its_text(vector: dict[str, Any]) -> None:
    key = None if vector["signing_key"] is None else bytes.fromhex(vector["signing_key"])
    assert format_token(expected_token(vector["token"]), key=key) == vector["text"]


@by_id(VALID)
def test_valid_vector_parses_to_its_fields(vector: dict[str, Any]) -> None:
    token = parse_token(vector["text"], key=keys_of(vector))
    assert token == expected_token(vector["token"])
    fields = vector["token"]
    # The redundant spellings in the vector agree with each other.
    micros = (token.expires_at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    assert str(micros) == fields["expires_at_micros"]
    assert fields["expires_at"].endswith("Z") and len(fields["expires_at"].split(".")[1]) == 7
    segment = vector["text"].split(".")[1]
    assert base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)).hex() \
        == vector["payload_hex"]


@by_id(INVALID)
def test_invalid_vector_is_refused_with_its_message(vector: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_token(vector["text"], key=keys_of(vector))
    assert caught.value.field == "token"
    assert caught.value.message == vector["message"]


def run_guard(vector: dict[str, Any]) -> list[tuple[bool, str | None, str | None]]:
    """Each step's (admitted, reason, highest epoch) from the in-memory guard."""
    if vector["now"] is None:
        guard = InMemoryResourceGuard(ignore_expiry=True)
    else:
        now = datetime.fromisoformat(vector["now"])
        guard = InMemoryResourceGuard(clock=lambda: now)
    seen = []
    for step in vector["steps"]:
        decision = guard.admit(vector["resource_id"], parse_token(step["text"],
                                                                  key=keys_of(step)))
        seen.append((decision.ok, None if decision.reason is None else str(decision.reason),
                     None if decision.highest_epoch is None else str(decision.highest_epoch)))
    return seen


def expected_steps(vector: dict[str, Any]) -> list[tuple[bool, str | None, str | None]]:
    return [(s["admitted"], s["reason"], s["highest_epoch"]) for s in vector["steps"]]


@by_id(GUARD)
def test_guard_vector_is_decided_as_written(vector: dict[str, Any]) -> None:
    assert run_guard(vector) == expected_steps(vector)
    refused = {s["reason"] for s in vector["steps"] if not s["admitted"]}
    assert refused == ({vector["category"]} if vector["refusal"] else set())
    assert all(FenceReason(reason) for reason in refused)  # a reason the library names


# --- the specification's lists against the vectors ----------------------------------------

ITEM = re.compile(r"^(\d+)\. \*\*([RG]\d+)\*\* `([a-z0-9_]+)`:(.*?)(?=^\d+\. |^$)",
                  re.MULTILINE | re.DOTALL)
PLACEHOLDERS = {  # as they read once the message is escaped into a pattern
    "<segment>": "(payload|signature)",
    "<field>": "(tenant_id|logical_agent_id|binding_id|connector_id|lease_id"
               "|epoch\\ and\\ expires_at)",
    re.escape("U+XXXX"): "U\\+[0-9A-F]{4,6}",
}


def spec_items() -> dict[str, tuple[str, str]]:
    """Refusal id -> (category, message or reason pattern), from the numbered lists."""
    items: dict[str, tuple[str, str]] = {}
    for number, ident, category, body in ITEM.findall(SPEC_TEXT):
        assert ident[1:] == number, f"{ident} is item {number} of its list"
        said = re.search(r"(?:Message|Reason):\s+`([^`]+)`", body)
        assert said is not None, f"{ident} names no message or reason"
        pattern = re.escape(said.group(1))
        for placeholder, regex in PLACEHOLDERS.items():
            pattern = pattern.replace(placeholder, regex)
        items[ident] = (category, pattern)
    return items


def test_the_specification_lists_eighteen_parse_and_three_guard_refusals() -> None:
    # Guards the parsing below: a reformatted list must not quietly shrink to nothing.
    assert sorted(spec_items(), key=lambda i: (i[0], int(i[1:]))) == (
        [f"G{n}" for n in range(1, 4)] + [f"R{n}" for n in range(1, 19)])


def test_every_refusal_in_the_specification_has_a_vector() -> None:
    covered = {v["refusal"] for v in INVALID} | {v["refusal"] for v in GUARD if v["refusal"]}
    assert set(spec_items()) - covered == set()


@by_id(INVALID + [v for v in GUARD if v["refusal"]])
def test_vector_refusal_is_the_specifications(vector: dict[str, Any]) -> None:
    category, pattern = spec_items()[vector["refusal"]]
    assert vector["category"] == category
    said = vector.get("message") or vector["category"]  # a guard vector names its reason
    assert re.fullmatch(pattern, said), f"{said!r} is not what {vector['refusal']} says"


# --- a verifier written from the specification alone -------------------------------------

ALPHABET = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
WHITESPACE = {*range(0x09, 0x0E), *range(0x1C, 0x21), 0x85, 0xA0, 0x1680,
              *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000}
EPOCH_1970 = datetime(1970, 1, 1, tzinfo=UTC)


class Refused(Exception):
    """The spec-only decoder's refusal; ``args[0]`` is the refusal id of section 7."""


def spec_unb64(segment: str) -> bytes:
    if len(segment) % 4 == 1:
        raise Refused("R5")
    raw = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode() != segment:
        raise Refused("R6")
    return raw


def spec_id_refusal(value: str) -> str | None:
    """Section 4.1, steps 2 to 5."""
    if not value or len(value) > 128:
        return "R12" if not value else "R13"
    if ord(value[0]) in WHITESPACE or ord(value[-1]) in WHITESPACE:
        return "R14"
    if any(unicodedata.category(c) in ("Cc", "Cf") for c in value):
        return "R15"
    return None


def spec_decode(text: str, keys: list[bytes]) -> dict[str, str]:
    if len(text) > 4096:
        raise Refused("R1")
    parts = text.split(".")
    if parts[0] != "mlf1" or len(parts) not in (2, 3) or not all(
            p and set(p) <= ALPHABET for p in parts[1:]):
        v = parts[0]
        lowercase, digits = set("abcdefghijklmnopqrstuvwxyz"), set("0123456789")
        if (len(parts) > 1 and len(v) > 3 and set(v[:3]) <= lowercase
                and set(v[3:]) <= digits and not text.startswith("mlf1.")):
            raise Refused("R2")
        raise Refused("R3")
    if len(parts) == 3:
        if not keys:
            raise Refused("R4")
        mac = spec_unb64(parts[2])
        if len(mac) != 32:
            raise Refused("R7")
        signed = ("mlf1." + parts[1]).encode("ascii")
        # A list, not a generator: every key is tried, so timing tells nothing.
        if not any([hmac.compare_digest(mac, hmac.new(k, signed, "sha256").digest())  # noqa: C419
                    for k in keys]):
            raise Refused("R8")
    elif keys:
        raise Refused("R9")
    raw, pos, out = spec_unb64(parts[1]), 0, {}

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if pos + n > len(raw):
            raise Refused("R10")
        pos += n
        return raw[pos - n:pos]

    for name in ("tenant_id", "logical_agent_id", "binding_id", "connector_id"):
        try:
            value = take(struct.unpack(">H", take(2, name))[0], name).decode("utf-8")
        except UnicodeDecodeError:
            raise Refused("R11") from None
        refusal = spec_id_refusal(value)
        if refusal is not None:
            raise Refused(refusal)
        out[name] = value
    lease = take(16, "lease_id")
    epoch, micros = struct.unpack(">Qq", take(16, "epoch and expires_at"))
    if pos != len(raw):
        raise Refused("R16")
    if not 1 <= epoch < 2**63:
        raise Refused("R17")
    if not -62135596800000000 <= micros <= 253402300799999999:
        raise Refused("R18")
    expires = (EPOCH_1970 + timedelta(microseconds=micros)).isoformat(timespec="microseconds")
    return out | {"lease_id": str(UUID(bytes=lease)), "epoch": str(epoch),
                  "expires_at": expires.replace("+00:00", "Z"), "expires_at_micros": str(micros)}


def spec_keys(vector: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(k) for k in vector["keys"]]


def spec_guard(vector: dict[str, Any]) -> list[tuple[bool, str | None, str | None]]:
    """Section 8, written from the specification: identity, then epoch, then expiry."""
    bound: tuple[tuple[str, str, str], int] | None = None
    seen: list[tuple[bool, str | None, str | None]] = []
    for step in vector["steps"]:
        fields = spec_decode(step["text"], spec_keys(step))
        identity = (fields["tenant_id"], fields["logical_agent_id"], fields["binding_id"])
        epoch, reason = int(fields["epoch"]), None
        if bound is not None and bound[0] != identity:
            reason = "identity_mismatch"
        elif bound is not None and epoch < bound[1]:
            reason = "stale_epoch"
        elif vector["now"] is not None and fields["expires_at"] <= vector["now"]:
            reason = "token_expired"  # same fixed-width UTC format: text order is time order
        if reason is None:
            bound = (identity, epoch if bound is None else max(bound[1], epoch))
        seen.append((reason is None, reason, None if bound is None else str(bound[1])))
    return seen


@by_id(VALID)
def test_spec_decoder_agrees_with_valid_vector(vector: dict[str, Any]) -> None:
    assert spec_decode(vector["text"], spec_keys(vector)) == vector["token"]


@by_id(INVALID)
def test_spec_decoder_agrees_with_invalid_vector(vector: dict[str, Any]) -> None:
    with pytest.raises(Refused) as caught:
        spec_decode(vector["text"], spec_keys(vector))
    assert caught.value.args[0] == vector["refusal"]


@by_id(GUARD)
def test_spec_guard_agrees_with_guard_vector(vector: dict[str, Any]) -> None:
    assert spec_guard(vector) == expected_steps(vector)


# --- the id rules, for every code point ---------------------------------------------------

LIBRARY_ID_REFUSALS = {"must not be empty": "R12", "must be at most": "R13",
                       "must not start or end": "R14", "must not contain control": "R15"}


def library_id_refusal(value: str) -> str | None:
    try:
        check_id("id", value)
    except InvalidInput as bad:
        return next(r for start, r in LIBRARY_ID_REFUSALS.items()
                    if bad.message.startswith(start))
    return None


def test_id_rules_of_the_specification_hold_for_every_code_point() -> None:
    # The vectors sample the rules; this checks them for all of Unicode, inside an id and
    # at its edge, so the whitespace list and the categories in section 4.1 are complete.
    disagree = []
    for code in range(0x110000):
        if 0xD800 <= code <= 0xDFFF:
            continue  # not a scalar value: strict UTF-8 cannot carry it (rule 1)
        for value in (f"a{chr(code)}a", f"{chr(code)}a"):
            if spec_id_refusal(value) != library_id_refusal(value):
                disagree.append(f"U+{code:04X} in {value!r}")
    assert disagree == []


def test_the_specification_names_the_unicode_version_in_use() -> None:
    # Categories move between Unicode versions (section 10): if the runtime's database
    # changes, so does the set of valid ids, and the specification must say so.
    stated = re.search(r"\*\*Unicode (\d+\.\d+\.\d+)\*\*", SPEC_TEXT)
    assert stated is not None and stated.group(1) == unicodedata.unidata_version
