"""Holder metadata: a small payload a lease's holder sets when it acquires or takes over.

A gateway that runs many processes routes a request to the process holding the binding;
for that, the holder says where it can be reached (``{"endpoint": "10.0.0.7:8443"}``), and
whoever reads the lease (``current_holder()``, a refused acquire's ``result.holder``,
``mos-lease status``) sees it. It is an address book entry, not a credential: it is shown
to anyone who may read the lease, and for that same reason it is never written to the
audit log or to a notice payload (those are kept, or heard, far more widely).

The payload is bounded like every other input (:func:`check_metadata`) and kept as a
:class:`Metadata`: an immutable mapping, so a view handed to one caller cannot be changed
under another, and hashable and picklable like the frozen records that carry it.

The same rule is applied again where a store hands a row out (:func:`stored_metadata`): a
row written around the library (SQL run as the gateway role against a schema older than
migration 0010) may hold what no write through it could. Such metadata is withheld, never
passed on: the row reads with empty metadata and ``metadata_invalid`` set, and a WARNING
is logged once per lease. Metadata plays no part in a lease's safety, so every lease
operation on such a row works as on any other.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Final

from mos_lease.errors import InvalidInput
from mos_lease.identity import LeaseIdentity

MAX_METADATA_ENTRIES: Final = 16
"""The most entries holder metadata may have."""
MAX_METADATA_KEY_LENGTH: Final = 64
"""The longest a metadata key may be, in characters."""
MAX_METADATA_VALUE_LENGTH: Final = 512
"""The longest a metadata value may be, in characters."""
MAX_METADATA_BYTES: Final = 2048
"""The most UTF-8 bytes all keys and values of holder metadata may take together."""
METADATA_KEY_GRAMMAR: Final = r"[A-Za-z0-9_.\-]+"
"""The pattern every metadata key matches in full."""
_KEY_RE: Final = re.compile(METADATA_KEY_GRAMMAR)


class Metadata(Mapping[str, str]):
    """An immutable ``str -> str`` mapping, as holder metadata is kept and shown.

    Equal to any mapping with the same items (``Metadata() == {}``), hashable, and kept in
    key order so two equal payloads print the same. Built by :func:`check_metadata` from
    what a caller passed, and by the stores from what they read back.
    """

    __slots__ = ("_items",)
    _items: dict[str, str]

    def __init__(self, items: Mapping[str, str] | None = None) -> None:
        object.__setattr__(self, "_items", {} if not items else dict(sorted(items.items())))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Metadata is immutable")

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._items == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"Metadata({self._items!r})"

    def __reduce__(self) -> tuple[type[Metadata], tuple[dict[str, str]]]:
        return (Metadata, (dict(self._items),))


EMPTY_METADATA: Final = Metadata()
"""No holder metadata: what a lease shows when its holder set none."""


def check_metadata(field: str, value: object) -> Metadata:
    """``value`` (``None`` or a ``Mapping`` of ``str`` to ``str``) as :class:`Metadata`, or
    :class:`~mos_lease.errors.InvalidInput` naming ``field``.

    At most :data:`MAX_METADATA_ENTRIES` entries; each key 1..64 characters of
    :data:`METADATA_KEY_GRAMMAR`; each value at most 512 printable characters (no control
    characters, so no NUL, which PostgreSQL's ``jsonb`` cannot hold either); all keys and
    values together at most :data:`MAX_METADATA_BYTES` bytes of UTF-8. ``str`` subclasses
    are taken as the plain strings they hold.
    """
    if value is None:
        return EMPTY_METADATA
    if not isinstance(value, Mapping):
        raise InvalidInput(field, f"must be a mapping of str to str, not {type(value).__name__}")
    checked: dict[str, str] = {}
    size = 0
    # Copied once (and no further than one past the bound, whatever its length claims), so
    # a mapping that changes while it is read cannot pass with other items.
    items = list(itertools.islice(value.items(), MAX_METADATA_ENTRIES + 1))
    if len(items) > MAX_METADATA_ENTRIES:
        raise InvalidInput(field, f"at most {MAX_METADATA_ENTRIES} entries")
    for given_key, given in items:
        if not isinstance(given_key, str):
            raise InvalidInput(field, f"keys must be str, not {type(given_key).__name__}")
        key = str.__str__(given_key)
        if not 1 <= len(key) <= MAX_METADATA_KEY_LENGTH:
            raise InvalidInput(field,
                               f"a key must be 1 to {MAX_METADATA_KEY_LENGTH} characters")
        if not _KEY_RE.fullmatch(key):
            raise InvalidInput(field, f"key {key!r} does not match {METADATA_KEY_GRAMMAR}")
        if not isinstance(given, str):
            raise InvalidInput(f"{field}[{key!r}]",
                               f"must be a str, not {type(given).__name__}")
        item = str.__str__(given)
        if len(item) > MAX_METADATA_VALUE_LENGTH:
            raise InvalidInput(f"{field}[{key!r}]",
                               f"must be at most {MAX_METADATA_VALUE_LENGTH} characters")
        if not item.isprintable():
            raise InvalidInput(f"{field}[{key!r}]",
                               "must be printable (no control or separator characters but "
                               "space)")
        try:
            size += len(key) + len(item.encode("utf-8"))  # keys are ASCII by their grammar
        except UnicodeEncodeError:  # a lone surrogate; isprintable() already refuses those
            raise InvalidInput(f"{field}[{key!r}]", "must be encodable as UTF-8") from None
        if size > MAX_METADATA_BYTES:
            raise InvalidInput(field, f"keys and values must take at most "
                               f"{MAX_METADATA_BYTES} bytes of UTF-8 together")
        checked[key] = item
    if len(checked) != len(items):
        # Two keys equal as plain strings (a str subclass hashing differently): refuse
        # rather than keep one of them silently.
        raise InvalidInput(field, "keys must be distinct")
    return Metadata(checked)


_log = logging.getLogger(__name__)

# Payloads already found good, by their items: a gateway's holders mostly repeat one
# payload (the process's endpoint), read back with every renewal of every lease, so the
# check is paid once per payload, not once per row read. Only good payloads are kept, each
# as the Metadata the check made of it; a full cache starts over.
_CHECKED_MAX: Final = 512
_checked: dict[frozenset[tuple[object, object]], Metadata] = {}
# The leases (identity, epoch) whose withheld metadata was logged: one WARNING per lease and
# process, not one per read (a waiting gateway reads a binding every few seconds).
_WARNED_MAX: Final = 1024
_warned: dict[tuple[LeaseIdentity, int], None] = {}
_warned_lock = threading.Lock()


def stored_metadata(stored: object, identity: LeaseIdentity, epoch: int) -> Metadata | None:
    """Holder metadata as a store read it back for ``identity``'s lease at ``epoch``,
    judged by the rule every write passes (:func:`check_metadata`, not a second copy of
    it): the checked :class:`Metadata` (``None`` stored reads as :data:`EMPTY_METADATA`),
    or ``None`` if it breaks the rule, after a WARNING logged once per lease and process.

    Stores call this for every lease row they return, so what a reader gets
    (``current_holder()``, a refused acquire's ``result.holder``, ``mos-lease status``) is
    never anything a write could not have set."""
    if stored is None:
        return EMPTY_METADATA
    key: frozenset[tuple[object, object]] | None = None
    if isinstance(stored, Mapping):
        try:
            key = frozenset(stored.items())
        except TypeError:  # an unhashable value (a nested object): not a good payload
            key = None
        else:
            if not key:
                return EMPTY_METADATA
            found = _checked.get(key)
            if found is not None:
                return found
    try:
        checked = check_metadata("holder_metadata", stored)
    except InvalidInput as problem:
        _warn_once(identity, epoch, problem)
        return None
    if key is not None:
        if len(_checked) >= _CHECKED_MAX:
            _checked.clear()
        _checked[key] = checked
    return checked


def _warn_once(identity: LeaseIdentity, epoch: int, problem: InvalidInput) -> None:
    lease = (identity, epoch)
    with _warned_lock:
        if lease in _warned:
            return
        if len(_warned) >= _WARNED_MAX:
            del _warned[next(iter(_warned))]  # the oldest: dicts keep insertion order
        _warned[lease] = None
    # Everything that came from the row is printed by its repr (control characters
    # escaped): a log line never carries a raw escape sequence.
    _log.warning("holder metadata of lease %r/%r/%r at epoch %d is withheld: it breaks the "
                 "metadata rules (%r); it reads as empty with metadata_invalid set until a "
                 "takeover replaces it", identity.tenant_id, identity.logical_agent_id,
                 identity.binding_id, epoch, str(problem))
