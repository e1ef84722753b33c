"""The fencing token: the lease context in a compact, versioned text form.

An adapter puts the token on everything it sends to a downstream effect boundary (an HTTP
header, a message field, an environment variable of a command), and the boundary parses it
and hands it to a :class:`~mos_lease.fencing.ResourceGuard`. This module is pure: no I/O, no
clock, no randomness.

Text form (all base64url without padding, every byte of it canonical)::

    mlf1.<payload>                 unsigned
    mlf1.<payload>.<mac>           signed: HMAC-SHA256(key, "mlf1.<payload>"), 32 bytes

``payload`` is the binary encoding of the token's fields, in this order: tenant id, logical
agent id, binding id, connector id (each a big-endian u16 byte length and UTF-8 bytes), the
lease UUID (16 bytes), the epoch (u64) and the expiry (i64 microseconds since the Unix epoch,
UTC). Nothing may follow the last field.

What is in the token, and why:

* the identity and the epoch are what a guard compares: epochs of one binding are ordered,
  epochs of different bindings are not, so a guard needs both;
* the connector id and lease UUID let a boundary log *who* acted and let the same-database
  effect helper (:mod:`mos_lease_pg.effects`) run the same full match the gateway runs;
* ``expires_at`` (the context's expiry: the earlier of grant and lease, in store time) lets
  a boundary that chooses to trust its clock refuse a token long after its lease ended, even
  when no newer epoch has reached that boundary yet. Guards ignore it unless configured.

What is not, and why: scopes (authorization is the gateway's decision, made before the
adapter ran; a boundary only orders holders), the correlation id (tracing has its own
headers; every extra field is one more thing to keep out of logs and to tamper with), and
anything secret (the token is not a credential: it grants nothing, it only lets a boundary
refuse what is older).

Tamper evidence: an unsigned token is strictly parsed but anyone can write one, so it can
only be trusted as far as its transport is. A gateway and a resource that share a key sign
and verify; then a changed epoch or identity is refused. The parser is strict in both forms:
one token has exactly one text, so a text that parses always formats back to itself.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import struct
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final
from uuid import UUID

import attrs

from mos_lease.context import ConnectorExecutionContext
from mos_lease.errors import InvalidInput
from mos_lease.identity import MAX_EPOCH, LeaseIdentity, check_epoch, check_id, check_identity

VERSION: Final = "mlf1"
MAX_TOKEN_LENGTH: Final = 4096
"""Longer input is refused before any decoding (a maximal valid token is ~2.8 kB)."""
MIN_KEY_LENGTH: Final = 16
MAC_LENGTH: Final = 32

_FIELD: Final = "token"
_UNIX_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
# The whole grammar in one expression, anchored by fullmatch: no surrounding whitespace, no
# newline sneaking past "$", nothing but the base64url alphabet inside the segments.
_TEXT_RE: Final = re.compile(r"mlf1\.([A-Za-z0-9_-]+)(?:\.([A-Za-z0-9_-]+))?")
_VERSION_RE: Final = re.compile(r"[a-z]{3}[0-9]+\.")


def _check_lease_id(_inst: object, _attr: object, value: Any) -> None:
    if not isinstance(value, UUID):
        raise InvalidInput("lease_id", f"must be a UUID, not {type(value).__name__}")


def _check_expiry(_inst: object, _attr: object, value: Any) -> None:
    if not isinstance(value, datetime):
        raise InvalidInput("expires_at", f"must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        # A naive time would be read in whatever zone the parsing side lives in.
        raise InvalidInput("expires_at", "must be timezone-aware")


def _to_utc(value: datetime) -> datetime:
    # One instant has one encoding; normalizing here keeps ``from_context`` == ``parse``.
    # The result is a plain datetime computed by datetime's own arithmetic, so a subclass
    # cannot carry overridden comparisons into a guard.
    if isinstance(value, datetime) and datetime.utcoffset(value) is not None:
        try:
            return _UNIX_EPOCH + datetime.__sub__(value, _UNIX_EPOCH)
        except OverflowError:
            raise InvalidInput("expires_at", "is out of range") from None
    return value


def _plain_identity(value: object) -> LeaseIdentity:
    return check_identity("identity", value)


def _plain_connector_id(value: object) -> str:
    return check_id("connector_id", value)


def _plain_epoch(value: object) -> int:
    return check_epoch("epoch", value)


@attrs.frozen(slots=True)
class FencingToken:
    """What a downstream boundary learns about the lease an action was taken under.

    Plain data, not a capability: holding a token authorizes nothing. Epochs are only
    comparable between tokens of the same ``identity``.
    """

    # Converters, not validators: what is kept is the checked plain value, so a subclass
    # whose comparisons lie (an int that is never less than anything) cannot reach a guard.
    identity: LeaseIdentity = attrs.field(converter=_plain_identity)
    connector_id: str = attrs.field(converter=_plain_connector_id)
    lease_id: UUID = attrs.field(validator=_check_lease_id)
    epoch: int = attrs.field(converter=_plain_epoch)
    expires_at: datetime = attrs.field(converter=_to_utc, validator=_check_expiry)

    @classmethod
    def from_context(cls, context: ConnectorExecutionContext) -> FencingToken:
        """The token of a validated context: its identity, connector, lease UUID, epoch and
        expiry (never its scopes or correlation id). Raises ``InvalidInput`` for anything
        but a ``ConnectorExecutionContext``."""
        if not isinstance(context, ConnectorExecutionContext):
            raise InvalidInput("context", "must be a ConnectorExecutionContext, not "
                               f"{type(context).__name__}")
        return cls(context.identity, context.connector_id, context.lease_id, context.epoch,
                   context.expires_at)


# --- encoding -----------------------------------------------------------------------------


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64decode(text: str, what: str) -> bytes:
    """Decode unpadded base64url, refusing every non-canonical spelling.

    Two texts differing only in the unused low bits of the last character decode to the same
    bytes; re-encoding and comparing refuses the non-canonical one, so a token has one text.
    """
    if len(text) % 4 == 1:
        raise InvalidInput(_FIELD, f"{what} is not valid base64url")
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(_FIELD, f"{what} is not valid base64url") from None
    if _b64encode(raw) != text:
        raise InvalidInput(_FIELD, f"{what} is not canonical base64url")
    return raw


def _encode_payload(token: FencingToken) -> bytes:
    out = bytearray()
    ident = token.identity
    for part in (ident.tenant_id, ident.logical_agent_id, ident.binding_id,
                 token.connector_id):
        raw = part.encode("utf-8")
        out += struct.pack(">H", len(raw)) + raw
    micros = (token.expires_at - _UNIX_EPOCH) // timedelta(microseconds=1)
    out += token.lease_id.bytes + struct.pack(">Qq", token.epoch, micros)
    return bytes(out)


class _Reader:
    """Reads fields off the payload; every shortfall is an ``InvalidInput``."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.raw):
            raise InvalidInput(_FIELD, f"payload ends inside {what}")
        chunk = self.raw[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def text(self, what: str) -> str:
        (length,) = struct.unpack(">H", self.take(2, what))
        try:
            value = self.take(length, what).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(_FIELD, f"{what} is not valid UTF-8") from None
        try:
            return check_id(what, value)
        except InvalidInput as bad:
            raise InvalidInput(_FIELD, str(bad)) from None


def _decode_payload(raw: bytes) -> FencingToken:
    reader = _Reader(raw)
    tenant = reader.text("tenant_id")
    agent = reader.text("logical_agent_id")
    binding = reader.text("binding_id")
    connector = reader.text("connector_id")
    lease_id = UUID(bytes=reader.take(16, "lease_id"))
    epoch, micros = struct.unpack(">Qq", reader.take(16, "epoch and expires_at"))
    if reader.pos != len(raw):
        raise InvalidInput(_FIELD, "unexpected bytes after the last field")
    if not 1 <= epoch <= MAX_EPOCH:
        raise InvalidInput(_FIELD, f"epoch must be between 1 and {MAX_EPOCH}")
    try:
        expires_at = _UNIX_EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        raise InvalidInput(_FIELD, "expires_at is out of range") from None
    return FencingToken(LeaseIdentity(tenant, agent, binding), connector, lease_id, epoch,
                        expires_at)


# --- keys ---------------------------------------------------------------------------------


def _check_key(field: str, key: object) -> bytes:
    if not isinstance(key, bytes):
        raise InvalidInput(field, f"a key must be bytes, not {type(key).__name__}")
    if len(key) < MIN_KEY_LENGTH:
        raise InvalidInput(field, f"a key must be at least {MIN_KEY_LENGTH} bytes")
    return key


def _keys(key: bytes | Sequence[bytes]) -> tuple[bytes, ...]:
    # Several keys make rotation possible: verify with (new, old), sign with new.
    if isinstance(key, bytes):
        keys: tuple[object, ...] = (key,)
    elif isinstance(key, list | tuple):
        keys = tuple(key)
    else:
        raise InvalidInput("key", f"must be bytes or a list of bytes, not {type(key).__name__}")
    if not keys:
        raise InvalidInput("key", "must name at least one key")
    return tuple(_check_key("key", k) for k in keys)


def _mac(key: bytes, signed_part: str) -> bytes:
    return hmac.new(key, signed_part.encode("ascii"), hashlib.sha256).digest()


# --- public functions ---------------------------------------------------------------------


def format_token(source: ConnectorExecutionContext | FencingToken, *,
                 key: bytes | None = None) -> str:
    """The text form of ``source``'s fencing token, signed with ``key`` if one is given."""
    token = source if isinstance(source, FencingToken) else FencingToken.from_context(source)
    signed_part = f"{VERSION}.{_b64encode(_encode_payload(token))}"
    if key is None:
        return signed_part
    return f"{signed_part}.{_b64encode(_mac(_check_key('key', key), signed_part))}"


def parse_token(text: object, *, key: bytes | Sequence[bytes] | None = None) -> FencingToken:
    """Parse a token, raising :class:`~mos_lease.errors.InvalidInput` (field ``"token"``) on
    anything malformed, oversized, of an unknown version or, with ``key``, not signed by it.

    With ``key`` (or several, for rotation) a signature is required and checked before any
    field is decoded. Without a key only the unsigned form is accepted: a signed token
    reaching a boundary that cannot check it means the boundary is misconfigured, and
    quietly ignoring the signature would hide that.
    """
    keys = None if key is None else _keys(key)
    if not isinstance(text, str):
        raise InvalidInput(_FIELD, f"must be a str, not {type(text).__name__}")
    if len(text) > MAX_TOKEN_LENGTH:
        raise InvalidInput(_FIELD, f"must be at most {MAX_TOKEN_LENGTH} characters")
    match = _TEXT_RE.fullmatch(text)
    if match is None:
        if _VERSION_RE.match(text) and not text.startswith(f"{VERSION}."):
            raise InvalidInput(_FIELD, "unsupported token version")
        raise InvalidInput(_FIELD, f"not a {VERSION} fencing token")
    payload_text, mac_text = match.group(1), match.group(2)
    if mac_text is not None:
        if keys is None:
            raise InvalidInput(_FIELD, "is signed; a key is needed to verify it")
        mac = _b64decode(mac_text, "signature")
        if len(mac) != MAC_LENGTH:
            raise InvalidInput(_FIELD, "signature has the wrong length")
        signed_part = f"{VERSION}.{payload_text}"
        # Check every key (no early exit), so timing does not tell which key matched.
        valid = [hmac.compare_digest(mac, _mac(k, signed_part)) for k in keys]
        if not any(valid):
            raise InvalidInput(_FIELD, "signature does not match")
    elif keys is not None:
        raise InvalidInput(_FIELD, "is not signed but a signature is required")
    return _decode_payload(_b64decode(payload_text, "payload"))
