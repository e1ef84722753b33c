"""The checks every value a caller hands the coordinator goes through before anything else.

Bad input raises :class:`~mos_lease.errors.InvalidInput` (an argument of a call) or
:class:`~mos_lease.errors.ConfigurationError` (an option of the constructor) naming what is
wrong, and nothing is read or written. What passes is rebuilt from plain values (or kept,
if it is plain already), so nothing a caller subclassed takes part in a fencing comparison.

:class:`CheckedInputs` remembers what it already checked, recognised by object identity:
a gateway validates with the same identity and scopes objects over and over, and renews
with the same identities every tick, and checking them again each time was most of the
coordinator's own cost of a validation and a third of a batched heartbeat's.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Final, Generic, TypeVar, cast
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
"""The most leases one ``heartbeat_many`` renews (and one ``acquire_many``,
``takeover_many``, ``release_many`` or ``current_holders`` call takes)."""
MAX_REMEMBERED: Final = 1024
"""How many scope texts :class:`CheckedInputs` keeps (then it starts over). Identities are
remembered for as long as they live, however many there are."""


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


def check_batch(leases: object, field: str = "leases",
                item: type[object] = LeaseHandle) -> Sequence[object]:
    """A batch operation's items (``heartbeat_many``'s leases, by default): a sequence (not
    one ``item``, not a string) of at most :data:`MAX_BATCH` of them; each is checked by the
    caller."""
    if isinstance(leases, item | str | bytes) or not isinstance(leases, Sequence):
        raise InvalidInput(field, f"must be a sequence of {item.__name__}")
    if len(leases) > MAX_BATCH:
        raise InvalidInput(field, f"at most {MAX_BATCH} {field} per batch")
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
    given = lease.scopes
    scopes = scopes_check("lease.scopes", given)
    if (type(lease) is LeaseHandle and identity is lease.identity
            and connector_id is lease.connector_id and lease_id is lease.lease_id
            and epoch is lease.epoch and type(given) is tuple
            and all(type(scope) is str for scope in given) and given == scopes):
        # Plain and normalized already (the handle a heartbeat returned, renewed by the
        # next one): a rebuild would be an equal copy, one more object per lease per tick
        # for the garbage collector of a supervisor renewing thousands.
        return lease
    return LeaseHandle(identity=identity, connector_id=connector_id, lease_id=lease_id,
                       epoch=epoch, scopes=scopes, expires_at=lease.expires_at)


class _Entry(weakref.ref[Any]):
    """One remembered answer: a weak reference to the object it is for, which carries the
    object's fields as they were checked and the answer (``None``: the object is its own).
    One object per entry: little for the garbage collector to go through."""

    __slots__ = ("answer", "fields", "key")

    key: int
    fields: tuple[object, ...]
    answer: Any


class _Memory(Generic[A]):
    """Answers for objects that are still alive, found by object identity.

    Each entry is keyed by a weak reference and goes when its object does, so a gateway's
    10,000 identities are all remembered while it keeps them, nothing is kept alive for the
    memory's sake, and no bound makes a large gateway start over on every tick. An entry
    also holds the object's fields as they were checked: a hit needs every field to be
    still the very same object (``object.__setattr__`` can change a frozen instance, and
    then a field is another object). An object that is its own answer is stored as
    ``None``, since a strong reference to it would keep it alive forever.
    """

    __slots__ = ("__weakref__", "_entries", "_forget")

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        # One callback for every entry; it holds the memory weakly, so a coordinator's
        # memory goes with it, not with the last object it ever checked.
        self._forget = functools.partial(_forget, weakref.ref(self))

    def get(self, value: object, fields: tuple[object, ...]) -> A | None:
        entry = self._entries.get(id(value))
        if entry is None or entry() is not value:
            return None
        for checked, now in zip(entry.fields, fields):  # noqa: B905 (always of one length)
            if checked is not now:
                return None
        answer = entry.answer
        return cast(A, value) if answer is None else cast(A, answer)

    def put(self, value: A, fields: tuple[object, ...], answer: A) -> None:
        entry = _Entry(value, self._forget)
        entry.key = key = id(value)
        entry.fields = fields
        entry.answer = None if answer is value else answer
        self._entries[key] = entry

    def __len__(self) -> int:
        return len(self._entries)


def _forget(memory: weakref.ref[_Memory[Any]], dead: _Entry) -> None:
    live = memory()
    if live is not None and live._entries.get(dead.key) is dead:  # not a newer object's
        live._entries.pop(dead.key, None)


class CheckedInputs:
    """Identities and scopes already checked, recognised by object identity.

    A remembered answer is given only for the very object it was computed from, and only
    where that object cannot have changed since: an identity of exactly its class whose
    fields are still the very objects that were checked (see :class:`_Memory`), and
    scopes given as exactly a ``tuple`` or ``frozenset`` (immutable; a list may change
    between two calls, so it is checked every time). Comparing by identity, never by ``==``,
    so a look-alike with a lying ``__eq__`` cannot borrow an answer; the one exception is a
    tuple of exact strings, whose ``==`` is the strings' own, remembered by its text. A
    handle is checked each time (its expiry changes with every renewal, so a memory of
    handles would churn), but with these answers, and is not rebuilt when it is plain.
    """

    __slots__ = ("_identities", "_scope_texts", "_scopes")

    def __init__(self) -> None:
        self._identities: _Memory[LeaseIdentity] = _Memory()
        self._scopes: _Memory[Scopes] = _Memory()
        # a tuple of exact strings -> its normalized scopes
        self._scope_texts: dict[tuple[str, ...], Scopes] = {}

    def identity(self, field: str, value: object) -> LeaseIdentity:
        """:func:`~mos_lease.identity.check_identity`, remembered."""
        if type(value) is not LeaseIdentity:
            return check_identity(field, value)
        fields = (value.tenant_id, value.logical_agent_id, value.binding_id)
        known = self._identities.get(value, fields)
        if known is not None:
            return known
        checked = check_identity(field, value)
        self._identities.put(value, fields, checked)
        if checked is not value:
            # The checked identity travels on (in the handle a call returns, say) and comes
            # back as the next call's input: it is its own answer.
            self._identities.put(checked, (checked.tenant_id, checked.logical_agent_id,
                                           checked.binding_id), checked)
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
        known = self._scopes.get(value, ())
        if known is not None:
            return known
        scopes = normalize_scopes(field, value)
        self._scopes.put(cast(Scopes, value), (), scopes)
        return scopes

    def handle(self, lease: object) -> LeaseHandle:
        """:func:`check_handle`, with the handle's identity and scopes remembered."""
        return check_handle(lease, self.identity, self.scopes)
