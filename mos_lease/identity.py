"""Identity values and the normalization of everything a caller hands in.

Every public entry point runs its arguments through these functions before anything else
happens, so bad input raises :class:`~mos_lease.errors.InvalidInput` naming the field and
nothing is read or written.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable
from datetime import timedelta
from typing import Final

import attrs

from mos_lease.errors import InvalidInput

MAX_ID_LENGTH: Final = 128
MAX_SCOPES: Final = 64
MAX_SCOPE_LENGTH: Final = 128
MAX_SCOPE_ITEMS: Final = 4 * MAX_SCOPES  # items before deduplication
MAX_EPOCH: Final = 2**63 - 1  # PostgreSQL bigint; epochs never wrap past it
"""The highest epoch: a takeover at it is refused with ``epoch_exhausted``."""
LEASE_TTL_CAP: Final = timedelta(minutes=5)
"""The longest a lease lasts between renewals; options may lower it, never raise it."""
GRANT_TTL_CAP: Final = timedelta(seconds=30)
"""The longest a grant lasts; options may lower it, never raise it."""

# One scope is one or more lowercase segments joined by ":" ("tool:shell:run"). A segment
# starts with a letter or digit and continues with letters, digits, "_", "-" or ".".
# No wildcards: authorization is plain set inclusion, so a scope means exactly itself.
SCOPE_GRAMMAR: Final = r"[a-z0-9][a-z0-9_.\-]*(:[a-z0-9][a-z0-9_.\-]*)*"
"""The pattern every scope matches in full."""
_SCOPE_RE: Final = re.compile(SCOPE_GRAMMAR)

Scopes = tuple[str, ...]
"""Normalized scopes: deduplicated, sorted, each matching :data:`SCOPE_GRAMMAR`."""


def check_id(field: str, value: object) -> str:
    """Return ``value`` if it is an acceptable identifier, else raise ``InvalidInput``.

    Identifiers are compared byte for byte, so anything that could make two visually equal
    ids differ (surrounding whitespace, control or format characters) is refused rather than
    silently cleaned up.
    """
    if type(value) is not str:  # tested first: plain str is the common case
        if not isinstance(value, str):
            raise InvalidInput(field, f"must be a str, not {type(value).__name__}")
        # A str subclass could override comparison and make every fencing check pass:
        # continue with the plain string it holds.
        value = str.__str__(value)
    if not value:
        raise InvalidInput(field, "must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidInput(field, f"must be at most {MAX_ID_LENGTH} characters")
    if value != value.strip():
        raise InvalidInput(field, "must not start or end with whitespace")
    if value.isascii() and value.isprintable():
        return value  # the common case, decided in C
    for ch in value:
        # Control (Cc), format (Cf: bidi overrides, zero-width joiners, soft hyphen, ...)
        # and surrogate (Cs: not encodable as UTF-8) characters can make two ids that look
        # the same compare different, or smuggle bytes into logs; refuse them all.
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs"):
            raise InvalidInput(field, f"must not contain control characters (U+{ord(ch):04X})")
    return value


# Converters, not validators: they also turn str subclasses into plain strings.
def _tenant_id(value: str) -> str:
    return check_id("tenant_id", value)


def _logical_agent_id(value: str) -> str:
    return check_id("logical_agent_id", value)


def _binding_id(value: str) -> str:
    return check_id("binding_id", value)


@attrs.frozen(slots=True)
class LeaseIdentity:
    """The normalized identity of one logical agent binding.

    ``logical_agent_id`` is server-owned and stable; connectors come and go and are never
    part of the identity.
    """

    tenant_id: str = attrs.field(converter=_tenant_id)
    logical_agent_id: str = attrs.field(converter=_logical_agent_id)
    binding_id: str = attrs.field(converter=_binding_id)

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.logical_agent_id}/{self.binding_id}"


def check_identity(field: str, value: object) -> LeaseIdentity:
    """A plain, valid ``LeaseIdentity``: every field is checked again, since a subclass or
    ``object.__setattr__`` can put anything behind the constructor's back."""
    if not isinstance(value, LeaseIdentity):
        raise InvalidInput(field, f"must be a LeaseIdentity, not {type(value).__name__}")
    try:
        tenant = check_id("tenant_id", value.tenant_id)
        agent = check_id("logical_agent_id", value.logical_agent_id)
        binding = check_id("binding_id", value.binding_id)
    except InvalidInput as bad:
        raise InvalidInput(f"{field}.{bad.field}", bad.message) from None
    return LeaseIdentity(tenant, agent, binding)


def normalize_scopes(field: str, value: object) -> Scopes:
    """Deduplicate and sort scopes, refusing anything outside the grammar."""
    if isinstance(value, str | bytes):
        # A bare string is iterable; treating "tool:run" as eight one-letter scopes would
        # be a silent privilege bug.
        raise InvalidInput(field, "must be a collection of scope strings, not a single string")
    if not isinstance(value, Iterable):
        raise InvalidInput(field, f"must be a collection of str, not {type(value).__name__}")
    seen: set[str] = set()
    for count, given in enumerate(value, start=1):
        if count > MAX_SCOPE_ITEMS:
            # Counted before deduplication, so an endless iterator cannot hang the caller.
            raise InvalidInput(field, f"at most {MAX_SCOPE_ITEMS} scope items")
        if not isinstance(given, str):
            raise InvalidInput(field, f"scopes must be str, not {type(given).__name__}")
        # A subclass could lie in the subset checks: continue with the plain string it holds.
        item = given if type(given) is str else str.__str__(given)
        if len(item) > MAX_SCOPE_LENGTH:
            raise InvalidInput(field, f"a scope must be at most {MAX_SCOPE_LENGTH} characters")
        if not _SCOPE_RE.fullmatch(item):
            raise InvalidInput(field, f"scope {item!r} does not match {SCOPE_GRAMMAR}")
        seen.add(item)
        if len(seen) > MAX_SCOPES:
            raise InvalidInput(field, f"at most {MAX_SCOPES} distinct scopes")
    return tuple(sorted(seen))


_NO_TIME: Final = timedelta(0)


def normalize_ttl(field: str, value: object, cap: timedelta) -> timedelta:
    """Turn seconds (int/float) or a ``timedelta`` into a positive ``timedelta`` <= ``cap``."""
    if isinstance(value, bool):
        raise InvalidInput(field, "must be seconds or a timedelta, not bool")
    if isinstance(value, timedelta):
        ttl = value
    elif isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInput(field, "must be finite")
        # Compared before any conversion: an int beyond the float range must be refused,
        # not overflow.
        if value <= 0:
            raise InvalidInput(field, "must be positive")
        if value > cap.total_seconds():
            raise InvalidInput(field, f"must be at most {cap.total_seconds():g} s")
        ttl = timedelta(seconds=value)
    else:
        raise InvalidInput(field, f"must be seconds or a timedelta, not {type(value).__name__}")
    if ttl <= _NO_TIME:
        raise InvalidInput(field, "must be positive (at least 1 microsecond)")
    if ttl > cap:
        raise InvalidInput(field, f"must be at most {cap.total_seconds():g} s")
    return ttl


def check_epoch(field: str, value: object) -> int:
    if type(value) is not int:  # tested first: plain int is the common case
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInput(field, f"must be an int, not {type(value).__name__}")
        value = int.__index__(value)  # a subclass could lie in comparisons
    if not 1 <= value <= MAX_EPOCH:
        raise InvalidInput(field, f"must be between 1 and {MAX_EPOCH}")
    return value


def check_count(field: str, value: object, low: int, high: int) -> int:
    """An int in ``low..high`` (paging arguments and the like); bools are refused."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(field, f"must be an int between {low} and {high}")
    return value


def check_correlation_id(field: str, value: object) -> str | None:
    return None if value is None else check_id(field, value)
