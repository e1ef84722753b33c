"""The checks every value a caller hands the coordinator goes through before anything else.

Bad input raises :class:`~mos_lease.errors.InvalidInput` (an argument of a call) or
:class:`~mos_lease.errors.ConfigurationError` (an option of the constructor) naming what is
wrong, and nothing is read or written. What passes is rebuilt from plain values, so nothing
a caller subclassed takes part in a fencing comparison.

:class:`CheckedInputs` remembers what it already checked, recognised by object identity:
a gateway validates with the same identity and scopes objects over and over, and checking
them again each time was most of the coordinator's own cost of a validation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Final, TypeVar, cast
from uuid import UUID

from mos_lease.errors import ConfigurationError, InvalidInput
from mos_lease.identity import (
    LeaseIdentity,
    Scopes,
    check_epoch,
    check_id,
    check_identity,
    normalize_scopes,
    normalize_ttl,
)
from mos_lease.policy import ConnectorLeaseService
from mos_lease.records import LeaseHandle

A = TypeVar("A")

MAX_BATCH: Final = 1000
"""The most leases one ``heartbeat_many`` renews."""
MAX_REMEMBERED: Final = 1024
"""How many checked objects of each kind :class:`CheckedInputs` keeps (then it starts over)."""


def check_cap(name: str, value: object, hard_cap: timedelta) -> timedelta:
    """A TTL cap option: positive, and no higher than the library's ``hard_cap``."""
    try:
        return normalize_ttl(name, value, hard_cap)
    except InvalidInput as bad:
        raise ConfigurationError(
            f"{bad} (options may only tighten the {hard_cap.total_seconds():g} s cap)"
        ) from None


def check_retries(value: object) -> int:
    """The ``max_conflict_retries`` option: an int in 0..100."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        raise ConfigurationError("max_conflict_retries must be an int in 0..100")
    return value


def check_collaborators(policy: object, id_source: object, monotonic_clock: object) -> None:
    """The objects a coordinator is built with are of the kind it calls."""
    if policy is not None and (isinstance(policy, type)
                               or not isinstance(policy, ConnectorLeaseService)):
        raise ConfigurationError(
            f"policy must be a ConnectorLeaseService instance, not {type(policy).__name__}")
    if not callable(id_source):
        raise ConfigurationError("id_source must be a callable returning UUIDs")
    if not callable(monotonic_clock):
        raise ConfigurationError("monotonic_clock must be a callable returning seconds")


def check_adapter(adapter: object) -> None:
    """What ``invoke`` calls with the context must be callable."""
    if not callable(adapter):
        raise InvalidInput("adapter", f"must be callable, not {type(adapter).__name__}")


def check_batch(leases: object) -> Sequence[object]:
    """``heartbeat_many``'s leases: a sequence (not one handle, not a string) of at most
    :data:`MAX_BATCH` items; each item is checked as a handle by the caller."""
    if isinstance(leases, LeaseHandle | str | bytes) or not isinstance(leases, Sequence):
        raise InvalidInput("leases", "must be a sequence of LeaseHandle")
    if len(leases) > MAX_BATCH:
        raise InvalidInput("leases", f"at most {MAX_BATCH} leases per batch")
    return leases


def check_handle(lease: object,
                 identity_check: Callable[[str, object], LeaseIdentity] = check_identity,
                 scopes_check: Callable[[str, object], Scopes] = normalize_scopes
                 ) -> LeaseHandle:
    """Check every field of a (possibly hand-built) handle and return it rebuilt from plain,
    normalized values, so nothing a caller subclassed takes part in a fencing comparison.
    (:meth:`CheckedInputs.handle` passes its remembering checks of identity and scopes.)"""
    if not isinstance(lease, LeaseHandle):
        raise InvalidInput("lease", f"must be a LeaseHandle, not {type(lease).__name__}")
    lease_id = lease.lease_id
    if not isinstance(lease_id, UUID):
        raise InvalidInput("lease.lease_id", "must be a UUID")
    identity = identity_check("lease.identity", lease.identity)
    connector_id = check_id("lease.connector_id", lease.connector_id)
    if type(lease_id) is not UUID:
        lease_id = UUID(int=int.__index__(lease_id.int))
    epoch = check_epoch("lease.epoch", lease.epoch)
    scopes = scopes_check("lease.scopes", lease.scopes)
    return LeaseHandle(identity=identity, connector_id=connector_id, lease_id=lease_id,
                       epoch=epoch, scopes=scopes, expires_at=lease.expires_at)


class CheckedInputs:
    """Identities and scopes already checked, recognised by object identity.

    A remembered answer is given only for the very object it was computed from, and only
    where that object cannot have changed since: an identity of exactly
    :class:`LeaseIdentity` whose three fields are still the very strings that were checked
    (``object.__setattr__`` can change a frozen instance, and then a field is another
    object), and scopes given as exactly a ``tuple`` or ``frozenset`` (immutable; a list
    may change between two calls, so it is checked every time). Comparing by identity,
    never by ``==``, so a look-alike with a lying ``__eq__`` cannot borrow an answer; the
    one exception is a tuple of exact strings, whose ``==`` is the strings' own, remembered
    by its text.
    """

    __slots__ = ("_identities", "_scope_texts", "_scopes")

    def __init__(self) -> None:
        # id(object) -> (the object, kept alive so its id is not reused; the answer)
        self._identities: dict[int, tuple[object, LeaseIdentity]] = {}
        self._scopes: dict[int, tuple[object, Scopes]] = {}
        # a tuple of exact strings -> its normalized scopes
        self._scope_texts: dict[tuple[str, ...], Scopes] = {}

    def identity(self, field: str, value: object) -> LeaseIdentity:
        """:func:`~mos_lease.identity.check_identity`, remembered."""
        if type(value) is not LeaseIdentity:
            return check_identity(field, value)
        known = self._identities.get(id(value))
        if known is not None and known[0] is value:
            checked = known[1]
            if (value.tenant_id is checked.tenant_id
                    and value.logical_agent_id is checked.logical_agent_id
                    and value.binding_id is checked.binding_id):
                return checked
        checked = check_identity(field, value)
        _remember(self._identities, value, checked)
        # The checked identity travels on (in the handle a call returns, say) and comes
        # back as the next call's input: it is its own answer.
        _remember(self._identities, checked, checked)
        return checked

    def scopes(self, field: str, value: object) -> Scopes:
        """:func:`~mos_lease.identity.normalize_scopes`, remembered for immutable input."""
        kind = type(value)
        if kind is tuple and all(type(scope) is str for scope in cast(tuple[object, ...], value)):
            # Exact strings in an exact tuple hash and compare as their text, so such a
            # tuple is remembered by value: the fresh tuple of a row the store returned (in
            # the handle a heartbeat gives back) finds the answer of the last one.
            text = cast(tuple[str, ...], value)
            by_text = self._scope_texts.get(text)
            if by_text is None:
                by_text = normalize_scopes(field, text)
                if len(self._scope_texts) >= MAX_REMEMBERED:
                    self._scope_texts.clear()
                self._scope_texts[text] = by_text
            return by_text
        if kind is not frozenset:
            return normalize_scopes(field, value)
        known = self._scopes.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        scopes = normalize_scopes(field, value)
        _remember(self._scopes, value, scopes)
        return scopes

    def handle(self, lease: object) -> LeaseHandle:
        """:func:`check_handle`, with the handle's identity and scopes remembered."""
        return check_handle(lease, self.identity, self.scopes)


def _remember(memory: dict[int, tuple[object, A]], key: object, answer: A) -> None:
    if len(memory) >= MAX_REMEMBERED:
        memory.clear()  # bounded; the objects a gateway keeps using come back at once
    memory[id(key)] = (key, answer)
