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
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping
from typing import Final

from mos_lease.errors import InvalidInput

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
