"""Write ``specs/token_vectors.json``, the test vectors of the ``mlf1`` fencing token.

Usage: ``python specs/make_token_vectors.py [--check]`` (``--check`` compares instead of
writing and exits 1 if the committed file differs).

The encoder here is written from ``specs/token.md`` with ``struct``, ``base64`` and ``hmac``
alone and does not import ``mos_lease``: the vectors are then a second, independent statement
of the format, and ``tests/core/test_token_spec.py`` holds the library to them. Expected refusal
messages are written out by hand for the same reason. Everything is fixed (keys, UUIDs,
times), so the output is the same on every run.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

USAGE = "usage: python specs/make_token_vectors.py [--check]"
OUTPUT = Path(__file__).resolve().parent / "token_vectors.json"

KEY_1 = bytes(range(0x00, 0x20))
KEY_2 = bytes(range(0x20, 0x40))
KEY_16 = b"sixteen byte key"  # exactly the minimum length
KEY_LONG = bytes(range(100))  # longer than SHA-256's block: HMAC hashes it first

LEASE = UUID("5d1f7a42-8c3b-4e6f-9a10-2b3c4d5e6f70")
EXPIRES = datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MIN_MICROS = -62135596800000000  # 0001-01-01T00:00:00Z
MAX_MICROS = 253402300799999999  # 9999-12-31T23:59:59.999999Z
MAX_EPOCH = 2**63 - 1
IDENTITY = ("acme", "agent-7", "slack-main")
OTHER_IDENTITY = ("acme", "agent-8", "slack-main")

Ids = tuple[str | bytes, str | bytes, str | bytes, str | bytes]
Vector = dict[str, Any]

# --- the encoder of specs/token.md --------------------------------------------------------


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def micros_of(instant: datetime) -> int:
    return (instant - UNIX_EPOCH) // timedelta(microseconds=1)


def iso(micros: int) -> str:
    instant = UNIX_EPOCH + timedelta(microseconds=micros)
    return instant.isoformat(timespec="microseconds").replace("+00:00", "Z")


def payload(ids: Ids = (*IDENTITY, "claude-a"), *, lease: bytes = LEASE.bytes,
            epoch: int = 7, micros: int | None = None, tail: bytes = b"") -> bytes:
    """Payload bytes; ids given as ``bytes`` go in as they are (for invalid UTF-8)."""
    out = b""
    for part in ids:
        raw = part.encode("utf-8") if isinstance(part, str) else part
        out += struct.pack(">H", len(raw)) + raw
    when = micros_of(EXPIRES) if micros is None else micros
    return out + lease + struct.pack(">Q", epoch) + struct.pack(">q", when) + tail


def unsigned(raw: bytes) -> str:
    return "mlf1." + b64(raw)


def mac(key: bytes, signed_part: str) -> str:
    return b64(hmac.new(key, signed_part.encode("ascii"), hashlib.sha256).digest())


def signed(raw: bytes, key: bytes = KEY_1) -> str:
    head = unsigned(raw)
    return f"{head}.{mac(key, head)}"


def spare_bits_set(segment: str) -> str:
    """``segment`` with the last character's lowest unused bit set: same bytes, other text."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    assert len(segment) % 4 in (2, 3), "needs a segment with unused bits"
    return segment[:-1] + alphabet[alphabet.index(segment[-1]) | 1]


# --- vectors ------------------------------------------------------------------------------


def keys_hex(keys: Sequence[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def valid(name: str, description: str, ids: tuple[str, str, str, str], *,
          lease: UUID = LEASE, epoch: int = 7, micros: int | None = None,
          signing_key: bytes | None = None, keys: Sequence[bytes] | None = None) -> Vector:
    when = micros_of(EXPIRES) if micros is None else micros
    raw = payload(ids, lease=lease.bytes, epoch=epoch, micros=when)
    text = unsigned(raw) if signing_key is None else signed(raw, signing_key)
    verify = ([] if signing_key is None else [signing_key]) if keys is None else list(keys)
    return {
        "id": name, "description": description, "text": text, "keys": keys_hex(verify),
        "signing_key": None if signing_key is None else signing_key.hex(),
        "payload_hex": raw.hex(),
        "token": {
            "tenant_id": ids[0], "logical_agent_id": ids[1], "binding_id": ids[2],
            "connector_id": ids[3], "lease_id": str(lease), "epoch": str(epoch),
            "expires_at": iso(when), "expires_at_micros": str(when),
        },
    }


CATEGORIES = {
    "R1": "too_long", "R2": "unsupported_version", "R3": "malformed",
    "R4": "signed_without_key", "R5": "base64_length", "R6": "base64_not_canonical",
    "R7": "signature_length", "R8": "signature_mismatch", "R9": "signature_required",
    "R10": "truncated", "R11": "bad_utf8", "R12": "id_empty", "R13": "id_too_long",
    "R14": "id_whitespace", "R15": "id_control", "R16": "trailing_bytes",
    "R17": "epoch_range", "R18": "expiry_range",
    "G1": "identity_mismatch", "G2": "stale_epoch", "G3": "token_expired",
}


def invalid(name: str, description: str, text: str, refusal: str, message: str, *,
            keys: Sequence[bytes] = ()) -> Vector:
    return {"id": name, "description": description, "text": text, "keys": keys_hex(keys),
            "refusal": refusal, "category": CATEGORIES[refusal], "message": message}


BASE_IDS = (*IDENTITY, "claude-a")
ASTRAL_128 = "\U0001f600" * 128  # 512 UTF-8 bytes, 256 UTF-16 units, 128 characters


def valid_vectors() -> list[Vector]:
    return [
        valid("unsigned", "plain ASCII ids, unsigned", BASE_IDS),
        valid("signed", "the same token signed", BASE_IDS, signing_key=KEY_1),
        valid("signed-rotation", "signed with the second of two keys the verifier holds",
              BASE_IDS, signing_key=KEY_2, keys=[KEY_1, KEY_2]),
        valid("signed-min-key", "signed with a key of exactly 16 bytes", BASE_IDS,
              signing_key=KEY_16),
        valid("minimal", "one-byte ids, epoch 1, all-zero UUID, expiry at the Unix epoch",
              ("t", "a", "b", "c"), lease=UUID(int=0), epoch=1, micros=0),
        valid("payload-mod-3-is-1", "payload length 1 more than a multiple of 3",
              (*IDENTITY, "claude-ab")),
        valid("payload-mod-3-is-2", "payload length 2 more than a multiple of 3",
              (*IDENTITY, "claude-abc")),
        valid("maximal", "128 four-byte characters per id, epoch 2^63-1, latest expiry, "
              "signed with a key longer than 64 bytes",
              (ASTRAL_128, ASTRAL_128, ASTRAL_128, ASTRAL_128),
              lease=UUID(int=2**128 - 1), epoch=MAX_EPOCH, micros=MAX_MICROS,
              signing_key=KEY_LONG),
        valid("ascii-128", "ids of exactly 128 ASCII characters",
              ("t" * 128, "a" * 128, "b" * 128, "c" * 128)),
        valid("earliest-expiry", "expires_at 0001-01-01T00:00:00Z",
              BASE_IDS, micros=MIN_MICROS),
        valid("before-1970", "expires_at one microsecond before the Unix epoch",
              BASE_IDS, micros=-1),
        valid("unicode-ids", "non-ASCII ids; whitespace inside an id is allowed",
              ("Zürich team", "агент 7", "a\u00a0b\u3000c", "\u65e5\u672c \u2028 x")),
        valid("not-normalized", "ids are not normalized: NFD spelling kept as it is",
              ("Zu\u0308rich", "agent-7", "slack-main", "claude-a")),
        valid("unassigned-and-private-use", "unassigned (U+0378) and private-use (U+E000) "
              "code points are allowed", ("\u0378", "\ue000", "b", "\U0010fffd")),
    ]


def invalid_vectors() -> list[Vector]:
    good = payload()
    text = unsigned(good)
    signed_text = signed(good)
    head, sig = signed_text.rsplit(".", 1)
    raised_epoch = unsigned(payload(epoch=8))
    # 70 bytes: the last base64 character has unused bits (69 bytes would have none).
    spare = unsigned(payload((*IDENTITY, "claude-ab")))[5:]
    spare_head = "mlf1." + spare_bits_set(spare)
    v = invalid
    out = [
        v("too-long", "4097 characters", "mlf1." + "A" * 4092, "R1",
          "must be at most 4096 characters"),
        v("too-long-signed", "a valid signed token followed by enough characters to pass "
          "4096", signed_text + "A" * (4097 - len(signed_text)), "R1",
          "must be at most 4096 characters"),
        v("version-2", "another version", "mlf2." + text[5:], "R2",
          "unsupported token version"),
        v("version-10", "a version that merely starts with mlf1", "mlf10." + text[5:], "R2",
          "unsupported token version"),
        v("uppercase-version", "the version is case-sensitive", "MLF1." + text[5:], "R3",
          "not a mlf1 fencing token"),
        v("empty", "the empty text", "", "R3", "not a mlf1 fencing token"),
        v("no-payload", "version only", "mlf1.", "R3", "not a mlf1 fencing token"),
        v("padding", "base64 padding", "mlf1." + spare + "==",
          "R3", "not a mlf1 fencing token"),
        v("standard-alphabet", "+ and / instead of - and _",
          "mlf1." + base64.b64encode(b"\xfb\xff" + good).decode().rstrip("="), "R3",
          "not a mlf1 fencing token"),
        v("trailing-newline", "a line break after the token", text + "\n", "R3",
          "not a mlf1 fencing token"),
        v("leading-space", "whitespace before the token", " " + text, "R3",
          "not a mlf1 fencing token"),
        v("non-ascii", "a non-ASCII character in the text", text + "\u00e9", "R3",
          "not a mlf1 fencing token"),
        v("empty-signature", "a dot with no signature after it", text + ".", "R3",
          "not a mlf1 fencing token"),
        v("three-segments", "a third segment", signed_text + "." + sig, "R3",
          "not a mlf1 fencing token", keys=[KEY_1]),
        v("signed-without-key", "a valid signed token at a verifier with no key",
          signed_text, "R4", "is signed; a key is needed to verify it"),
        v("payload-length-1-mod-4", "payload segment of 4k+1 characters", text + "A", "R5",
          "payload is not valid base64url"),
        v("signature-length-1-mod-4", "signature segment of 45 characters",
          head + "." + sig + "AA", "R5", "signature is not valid base64url", keys=[KEY_1]),
        v("payload-spare-bits", "payload's last character has unused bits set",
          "mlf1." + spare_bits_set(spare), "R6", "payload is not canonical base64url"),
        v("payload-spare-bits-signed", "non-canonical payload with a valid mac over that "
          "very text: canonical form is required of signed tokens too",
          f"{spare_head}.{mac(KEY_1, spare_head)}", "R6",
          "payload is not canonical base64url", keys=[KEY_1]),
        v("signature-spare-bits", "signature's last character has unused bits set",
          head + "." + spare_bits_set(sig), "R6", "signature is not canonical base64url",
          keys=[KEY_1]),
        v("signature-16-bytes", "a 16-byte signature", head + "." + b64(bytes(16)), "R7",
          "signature has the wrong length", keys=[KEY_1]),
        v("signature-33-bytes", "a 33-byte signature",
          head + "." + b64(base64.urlsafe_b64decode(sig + "=") + b"\x00"), "R7",
          "signature has the wrong length", keys=[KEY_1]),
        v("tampered-payload", "epoch raised from 7 to 8, the original mac kept",
          raised_epoch + "." + sig, "R8", "signature does not match", keys=[KEY_1]),
        v("tampered-mac", "first mac byte changed",
          head + "." + b64(bytes([base64.urlsafe_b64decode(sig + "=")[0] ^ 1])
                           + base64.urlsafe_b64decode(sig + "=")[1:]),
          "R8", "signature does not match", keys=[KEY_1]),
        v("other-key", "signed with a key the verifier does not hold", signed_text, "R8",
          "signature does not match", keys=[KEY_2]),
        v("rotated-out", "signed with a key no longer in the verifier's list", signed_text,
          "R8", "signature does not match", keys=[KEY_2, KEY_16]),
        v("signature-required", "an unsigned token at a verifier holding a key", text, "R9",
          "is not signed but a signature is required", keys=[KEY_1]),
        v("truncated-in-length", "payload ends inside the first length prefix",
          unsigned(good[:1]), "R10", "payload ends inside tenant_id"),
        v("truncated-in-id", "the length prefix claims more bytes than follow",
          unsigned(struct.pack(">H", 65535) + b"acme"), "R10",
          "payload ends inside tenant_id"),
        v("truncated-in-connector", "payload ends inside connector_id",
          unsigned(payload()[:len(payload()) - 32 - 3]), "R10",
          "payload ends inside connector_id"),
        v("truncated-in-lease", "payload ends inside lease_id", unsigned(good[:-17]), "R10",
          "payload ends inside lease_id"),
        v("truncated-in-expiry", "payload ends inside the last 16 bytes",
          unsigned(good[:-1]), "R10", "payload ends inside epoch and expires_at"),
        v("utf8-invalid-byte", "0xff in tenant_id",
          unsigned(payload((b"ac\xffme", *BASE_IDS[1:]))), "R11",
          "tenant_id is not valid UTF-8"),
        v("utf8-overlong", "an overlong encoding of '/' in logical_agent_id",
          unsigned(payload(("acme", b"a\xc0\xafb", "slack-main", "claude-a"))), "R11",
          "logical_agent_id is not valid UTF-8"),
        v("utf8-surrogate", "an encoded surrogate (U+D800) in binding_id",
          unsigned(payload(("acme", "agent-7", b"\xed\xa0\x80", "claude-a"))), "R11",
          "binding_id is not valid UTF-8"),
        v("utf8-truncated-sequence", "a multi-byte sequence cut by the length prefix",
          unsigned(payload((*IDENTITY, b"claude\xe2\x82"))), "R11",
          "connector_id is not valid UTF-8"),
        v("utf8-above-max", "a code point above U+10FFFF",
          unsigned(payload((b"\xf4\x90\x80\x80", *BASE_IDS[1:]))), "R11",
          "tenant_id is not valid UTF-8"),
        v("empty-tenant", "tenant_id of 0 bytes", unsigned(payload(("", *BASE_IDS[1:]))),
          "R12", "tenant_id: must not be empty"),
        v("empty-connector", "connector_id of 0 bytes", unsigned(payload((*IDENTITY, ""))),
          "R12", "connector_id: must not be empty"),
        v("empty-at-4096", "exactly 4096 characters is not too long: refused for what it "
          "holds", "mlf1." + "A" * 4091, "R12", "tenant_id: must not be empty"),
        v("id-129-ascii", "129 ASCII characters",
          unsigned(payload(("acme", "a" * 129, "slack-main", "claude-a"))), "R13",
          "logical_agent_id: must be at most 128 characters"),
        v("id-129-astral", "129 four-byte characters",
          unsigned(payload(("acme", "agent-7", ASTRAL_128 + "\U0001f600", "claude-a"))),
          "R13", "binding_id: must be at most 128 characters"),
        v("id-leading-space", "tenant_id starts with a space",
          unsigned(payload((" acme", *BASE_IDS[1:]))), "R14",
          "tenant_id: must not start or end with whitespace"),
        v("trailing-nbsp", "connector_id ends with U+00A0",
          unsigned(payload((*IDENTITY, "claude-a\u00a0"))), "R14",
          "connector_id: must not start or end with whitespace"),
        v("trailing-ideographic-space", "binding_id ends with U+3000",
          unsigned(payload(("acme", "agent-7", "slack\u3000", "claude-a"))), "R14",
          "binding_id: must not start or end with whitespace"),
        v("trailing-line-separator", "logical_agent_id ends with U+2028",
          unsigned(payload(("acme", "agent\u2028", "slack-main", "claude-a"))), "R14",
          "logical_agent_id: must not start or end with whitespace"),
        v("trailing-unit-separator", "U+001F at the end counts as whitespace (before the "
          "control check)", unsigned(payload((*IDENTITY, "claude-a\x1f"))), "R14",
          "connector_id: must not start or end with whitespace"),
        v("nul", "U+0000 inside tenant_id", unsigned(payload(("ac\x00me", *BASE_IDS[1:]))),
          "R15", "tenant_id: must not contain control characters (U+0000)"),
        v("delete", "U+007F inside connector_id",
          unsigned(payload((*IDENTITY, "claude\x7fa"))), "R15",
          "connector_id: must not contain control characters (U+007F)"),
        v("unit-separator-inside", "U+001F inside an id is a control character",
          unsigned(payload((*IDENTITY, "claude\x1fa"))), "R15",
          "connector_id: must not contain control characters (U+001F)"),
        v("zero-width-space", "U+200B (Cf) inside logical_agent_id",
          unsigned(payload(("acme", "agent\u200b7", "slack-main", "claude-a"))), "R15",
          "logical_agent_id: must not contain control characters (U+200B)"),
        v("bidi-override", "U+202E (Cf) inside binding_id",
          unsigned(payload(("acme", "agent-7", "slack\u202emain", "claude-a"))), "R15",
          "binding_id: must not contain control characters (U+202E)"),
        v("byte-order-mark", "U+FEFF (Cf) at the start of tenant_id: not whitespace here",
          unsigned(payload(("\ufeffacme", *BASE_IDS[1:]))), "R15",
          "tenant_id: must not contain control characters (U+FEFF)"),
        v("soft-hyphen", "U+00AD (Cf) inside connector_id",
          unsigned(payload((*IDENTITY, "claude\u00ada"))), "R15",
          "connector_id: must not contain control characters (U+00AD)"),
        v("trailing-byte", "one zero byte after expires_at", unsigned(payload(tail=b"\x00")),
          "R16", "unexpected bytes after the last field"),
        v("trailing-bytes-signed", "signed, with bytes after expires_at",
          signed(payload(tail=b"\x00" * 8)), "R16", "unexpected bytes after the last field",
          keys=[KEY_1]),
        v("epoch-0", "epoch 0", unsigned(payload(epoch=0)), "R17",
          "epoch must be between 1 and 9223372036854775807"),
        v("epoch-2^63", "epoch with the top bit set", unsigned(payload(epoch=2**63)), "R17",
          "epoch must be between 1 and 9223372036854775807"),
        v("epoch-2^64-1", "all epoch bits set", unsigned(payload(epoch=2**64 - 1)), "R17",
          "epoch must be between 1 and 9223372036854775807"),
        v("expiry-before-year-1", "one microsecond before 0001-01-01T00:00:00Z",
          unsigned(payload(micros=MIN_MICROS - 1)), "R18", "expires_at is out of range"),
        v("expiry-after-year-9999", "10000-01-01T00:00:00Z",
          unsigned(payload(micros=MAX_MICROS + 1)), "R18", "expires_at is out of range"),
        v("expiry-i64-min", "the smallest signed 64-bit value",
          unsigned(payload(micros=-(2**63))), "R18", "expires_at is out of range"),
        v("expiry-i64-max", "the largest signed 64-bit value",
          unsigned(payload(micros=2**63 - 1)), "R18", "expires_at is out of range"),
    ]
    names = [vector["id"] for vector in out]
    if len(names) != len(set(names)):
        raise ValueError("vector ids must be unique")
    return out


def step(token: str, keys: Sequence[bytes], *, admitted: bool, highest: int | None,
         reason: str | None = None) -> Vector:
    return {"text": token, "keys": keys_hex(keys), "admitted": admitted, "reason": reason,
            "highest_epoch": None if highest is None else str(highest)}


def guard_vectors() -> list[Vector]:
    def token(identity: tuple[str, str, str], epoch: int, micros: int | None = None) -> str:
        return signed(payload((*identity, "claude-a"), epoch=epoch, micros=micros))

    now = micros_of(EXPIRES) - 1_000_000  # one second before the usual expiry
    keys = [KEY_1]
    return [
        {"id": "other-identity", "refusal": "G1", "category": CATEGORIES["G1"],
         "description": "a valid token of another binding is refused whatever its epoch",
         "resource_id": "repo:main", "now": None,
         "steps": [
             step(token(IDENTITY, 5), keys, admitted=True, highest=5),
             step(token(OTHER_IDENTITY, 1), keys, admitted=False, highest=5,
                  reason="identity_mismatch"),
             step(token(OTHER_IDENTITY, 9), keys, admitted=False, highest=5,
                  reason="identity_mismatch"),
             step(token(IDENTITY, 5), keys, admitted=True, highest=5),
         ]},
        {"id": "stale-epoch", "refusal": "G2", "category": CATEGORIES["G2"],
         "description": "a lower epoch of the same binding is refused; equal and higher "
         "are admitted", "resource_id": "repo:main", "now": iso(now),
         "steps": [
             step(token(IDENTITY, 5), keys, admitted=True, highest=5),
             step(token(IDENTITY, 4), keys, admitted=False, highest=5,
                  reason="stale_epoch"),
             step(token(IDENTITY, 5), keys, admitted=True, highest=5),
             step(token(IDENTITY, 6), keys, admitted=True, highest=6),
             step(token(IDENTITY, 5), keys, admitted=False, highest=6,
                  reason="stale_epoch"),
         ]},
        {"id": "expired", "refusal": "G3", "category": CATEGORIES["G3"],
         "description": "a guard that trusts its clock refuses a token at its expires_at, "
         "and the refusal does not bind the resource", "resource_id": "repo:main",
         "now": iso(now),
         "steps": [
             step(token(OTHER_IDENTITY, 3, micros=now), keys, admitted=False, highest=None,
                  reason="token_expired"),
             step(token(IDENTITY, 2, micros=now + 1), keys, admitted=True, highest=2),
         ]},
        {"id": "expiry-ignored", "refusal": None, "category": None,
         "description": "a guard that ignores expiry judges epochs only",
         "resource_id": "repo:main", "now": None,
         "steps": [
             step(token(IDENTITY, 2, micros=0), keys, admitted=True, highest=2),
         ]},
    ]


def render() -> str:
    document = {
        "format": "mlf1",
        "specification": "specs/token.md",
        "generator": "specs/make_token_vectors.py",
        "valid": valid_vectors(),
        "invalid": invalid_vectors(),
        "guard": guard_vectors(),
    }
    # All ASCII: the vectors hold bidi overrides and zero-width characters, which would be
    # invisible, or reorder the text around them, if written raw.
    return json.dumps(document, indent=2, ensure_ascii=True) + "\n"


def main(argv: Sequence[str]) -> int:
    text = render()
    if list(argv) == ["--check"]:
        same = OUTPUT.exists() and OUTPUT.read_text(encoding="utf-8") == text
        print("up to date" if same else f"{OUTPUT} differs from the generator")
        return 0 if same else 1
    if argv:
        print(USAGE, file=sys.stderr)
        return 2
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
