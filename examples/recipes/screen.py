"""The screen every request to a gateway passes before the library sees anything of it.

The identity a gateway acts for comes from its own configuration (:mod:`.config`), never from
a caller. So a request that brings an identity of its own — a tenant, an agent, a binding, a
connector, a lease or an epoch, in the query string, a header or the JSON body — is refused
with ``403 caller_identity``, whatever else it carries; nothing of it reaches the
coordinator.

A name is judged by what it means, not by a list of spellings. It is read in one case (NFKC,
case-folded) and split into tokens at every character but the letters ``a`` to ``z`` (``-``,
``_``, digits, dots, spaces, other scripts); it names an identity when a token *contains*
one of :data:`IDENTITY_WORDS` — ``tenant``, ``agent``, ``logical``, ``bind``, ``connector``,
``identit``, ``lease``, ``epoch`` — so their plurals (``tenants``, ``identities``), forms
glued to a prefix or suffix (``tenantId``, ``xtenantname``, ``bindingRef``) and any other
token around them (``X-Tenant-Name``, ``x_mos_lease_epoch``, ``Agent2``) are refused alike.
A case change needs no split of its own: looking inside each token finds ``tenantName``, and
an HTTP server hands header names over in one case anyway (``X-TenantName`` reaches an ASGI
application as ``x-tenantname``). A token that merely contains a word (``release``,
``reagent``) is refused too: the screen errs on the side of refusing. Two header names
contain a word but name no identity, and are taken, compared whole and ignoring case
(:data:`NOT_IDENTITY_HEADERS`): ``User-Agent`` (the caller's HTTP software) and
``X-Mos-Lease-Hops`` (below); any other spelling of them (``X-Mos-Lease-Hop``,
``X_Mos_Lease_Hops``) is refused, and in the query string or the body they are refused like
any other identity name.

Everything else is an allow-list: the body is a JSON object ``{"text": ...}`` and nothing
more, the query string is empty, and the one header a gateway reads, ``X-Mos-Lease-Hops``,
counts how often the request was forwarded already. Other headers (``Accept``,
``Content-Type``, ``X-Request-Id``, ...) are neither read nor passed on.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable
from typing import Final
from urllib.parse import parse_qsl

import attrs

HOPS_HEADER: Final = "X-Mos-Lease-Hops"
MAX_BODY_BYTES: Final = 16 * 1024
MAX_TEXT: Final = 1000
MAX_HOPS_VALUE: Final = 8
_DIGITS: Final = re.compile(r"[0-9]{1,2}")  # ASCII only: str.isdigit() takes "²" too
# The words an identity's parts, a lease and an epoch are named with, looked for inside
# every token of a name (see the module's docstring). A stem stands for its plain variants:
# "bind" for bind, binding and bindings; "identit" for identity and identities.
IDENTITY_WORDS: Final = ("tenant", "agent", "logical", "bind", "connector", "identit", "lease",
                         "epoch")
# Header names that contain a word but name no identity, compared whole after lower-casing:
# the hop count this screen reads, and the HTTP software every client sends (curl included).
NOT_IDENTITY_HEADERS: Final = frozenset({HOPS_HEADER.lower(), "user-agent"})
_NOT_LETTERS: Final = re.compile(r"[^a-z]+")


@attrs.frozen
class Refusal:
    """A request refused: the HTTP status, a stable reason code and a sentence."""

    status: int
    reason: str
    detail: str

    def body(self) -> dict[str, object]:
        """The JSON body of the reply."""
        return {"error": self.reason, "detail": self.detail}


@attrs.frozen
class Work:
    """A request that passed the screen: the text to record and its hop count."""

    text: str
    hops: int

    def forward_body(self) -> bytes:
        """The body sent on to the holder: rebuilt from what passed, not the caller's bytes."""
        return json.dumps({"text": self.text}).encode("utf-8")


def tokens(name: str) -> list[str]:
    """``name`` read in one case and split at every character but ``a`` to ``z``."""
    folded = unicodedata.normalize("NFKC", name).casefold()
    return [token for token in _NOT_LETTERS.split(folded) if token]


def identity_word(name: str) -> str | None:
    """The word of :data:`IDENTITY_WORDS` that ``name`` (a query parameter, header or body
    field) names an identity with, or ``None``."""
    for token in tokens(name):
        for word in IDENTITY_WORDS:
            if word in token:
                return word
    return None


def is_identity_name(name: str) -> bool:
    """Whether ``name`` (a query parameter, header or body field) names an identity."""
    return identity_word(name) is not None


def _header_names_identity(name: str) -> bool:
    return name.lower() not in NOT_IDENTITY_HEADERS and is_identity_name(name)


def _caller_identity(where: str, name: str) -> Refusal:
    return Refusal(403, "caller_identity",
                   f"the {where} {name!r} names an identity ({identity_word(name)}); a "
                   "route's binding is the gateway's own configuration, never the caller's")


def screen(query: str, headers: Iterable[tuple[str, str]], body: bytes) -> Work | Refusal:
    """What ``query``, ``headers`` and ``body`` ask for, or why they are refused.

    A caller's identity is looked for everywhere first, so a request carrying one is always
    refused ``caller_identity``, never a milder reason that would invite a retry."""
    try:
        params = parse_qsl(query, keep_blank_values=True, max_num_fields=32)
    except ValueError:
        return Refusal(400, "unexpected_query", "this route takes no query parameters")
    hops_values: list[str] = []
    for name, value in headers:
        if _header_names_identity(name):
            return _caller_identity("header", name)
        if name.lower() == HOPS_HEADER.lower():
            hops_values.append(value)
    for name, _value in params:
        if is_identity_name(name):
            return _caller_identity("query parameter", name)
    fields = _body_fields(body)
    if isinstance(fields, Refusal):
        return fields
    for name in fields:
        if is_identity_name(name):
            return _caller_identity("body field", name)
    if params:
        return Refusal(400, "unexpected_query", "this route takes no query parameters")
    unknown = sorted(set(fields) - {"text"})
    if unknown:
        return Refusal(400, "unknown_field", f"the body has only \"text\", not {unknown}")
    text = fields.get("text")
    if not isinstance(text, str) or not 1 <= len(text) <= MAX_TEXT:
        return Refusal(400, "invalid_text",
                       f"\"text\" is a string of 1 to {MAX_TEXT} characters")
    hops = _hops(hops_values)
    if isinstance(hops, Refusal):
        return hops
    return Work(text, hops)


def _body_fields(body: bytes) -> dict[str, object] | Refusal:
    if len(body) > MAX_BODY_BYTES:
        return too_large()
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past the parser
        return Refusal(400, "invalid_body", "the body is a JSON object: {\"text\": \"...\"}")
    if not isinstance(fields, dict):
        return Refusal(400, "invalid_body", "the body is a JSON object: {\"text\": \"...\"}")
    return fields


def _hops(values: list[str]) -> int | Refusal:
    if not values:
        return 0
    if len(values) > 1 or not _DIGITS.fullmatch(values[0]) or int(values[0]) > MAX_HOPS_VALUE:
        return Refusal(400, "invalid_hops",
                       f"{HOPS_HEADER} is one integer from 0 to {MAX_HOPS_VALUE}")
    return int(values[0])


def too_large() -> Refusal:
    """The refusal of a body over :data:`MAX_BODY_BYTES` (also judged from Content-Length,
    before the body is read)."""
    return Refusal(413, "body_too_large", f"the body is at most {MAX_BODY_BYTES} bytes")
