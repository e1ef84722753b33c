"""Execution grants: short-lived, process-local capabilities.

A grant is accepted only by the registry that minted it, and only as the very object it
handed out: the registry keeps the object and checks identity, then an HMAC under a secret
that exists only in this process, so a copy, a pickle round trip, a hand-built object with the
same fields or fields changed with ``object.__setattr__`` are all refused. A new registry (a
restarted gateway) has a new secret and knows none of the old grants. In a forked child every
registry forgets everything, so a grant cannot be smuggled across ``fork()`` either.
"""

from __future__ import annotations

import datetime as _datetime
import hashlib
import heapq
import hmac
import operator
import os
import secrets
import threading
import weakref
from datetime import datetime
from typing import NoReturn
from uuid import UUID

import attrs

from mos_lease.errors import GrantNotTransferable
from mos_lease.identity import LeaseIdentity, Scopes
from mos_lease.vocabulary import Reason


@attrs.frozen(slots=True, eq=False)
class ExecutionGrant:
    """A grant bound to identity, connector, lease id, epoch, scopes and expiry.

    Equality is identity: two grants are the same grant only if they are the same object.
    """

    grant_id: UUID
    identity: LeaseIdentity
    connector_id: str
    lease_id: UUID
    epoch: int
    scopes: Scopes
    expires_at: datetime
    correlation_id: str
    _mac: bytes = attrs.field(repr=False)

    def _refuse(self, *_args: object) -> NoReturn:
        raise GrantNotTransferable(
            "execution grants are process-local capabilities and cannot be copied or pickled"
        )

    __copy__ = _refuse
    __deepcopy__ = _refuse
    __reduce__ = _refuse
    __reduce_ex__ = _refuse
    __getstate__ = _refuse


def _message(grant_id: UUID, identity: LeaseIdentity, connector_id: str, lease_id: UUID,
             epoch: int, scopes: Scopes, expires_at: datetime, correlation_id: str) -> bytes:
    # Length-prefixed fields, so no two different field tuples encode to the same bytes.
    parts = (str(grant_id), identity.tenant_id, identity.logical_agent_id,
             identity.binding_id, connector_id, str(lease_id), str(epoch), *scopes, "\x00",
             expires_at.isoformat(), correlation_id)
    out = bytearray()
    for part in parts:
        raw = part.encode("utf-8", "surrogatepass")
        out += len(raw).to_bytes(4, "big") + raw
    return bytes(out)


def _parts(grant: ExecutionGrant) -> tuple[object, ...]:
    """Every object a grant is made of, down to values that cannot change in place (the
    UUIDs' ints, the identity's strings): a grant is unaltered exactly when each of these is
    still the very object it was minted with."""
    identity = grant.identity
    return (grant.grant_id, grant.grant_id.int, identity, identity.tenant_id,
            identity.logical_agent_id, identity.binding_id, grant.connector_id,
            grant.lease_id, grant.lease_id.int, grant.epoch, grant.scopes, grant.expires_at,
            grant.correlation_id, grant._mac)


def _well_typed(grant: ExecutionGrant) -> bool:
    """Whether every field of ``grant`` has exactly the type ``mint`` gives it (no
    subclasses: a subclass can override ``__str__``, ``__eq__`` or ``__hash__``).

    The datetime class is taken from its module at call time, not from this module's
    ``datetime`` name, which the clock-skew harness (tests/faults/clockskew.py) replaces
    with a subclass although the store's datetimes stay plain."""
    identity = grant.identity
    scopes = grant.scopes
    return (type(grant.grant_id) is UUID and type(grant.lease_id) is UUID
            and type(identity) is LeaseIdentity and type(identity.tenant_id) is str
            and type(identity.logical_agent_id) is str and type(identity.binding_id) is str
            and type(grant.connector_id) is str and type(grant.epoch) is int
            and type(scopes) is tuple and all(type(scope) is str for scope in scopes)
            and type(grant.expires_at) is _datetime.datetime
            and type(grant.correlation_id) is str
            and type(grant._mac) is bytes)


_LIVE_REGISTRIES: weakref.WeakSet[GrantRegistry] = weakref.WeakSet()


def _forget_all_after_fork() -> None:
    for registry in list(_LIVE_REGISTRIES):
        registry._forget()


os.register_at_fork(after_in_child=_forget_all_after_fork)


class GrantRegistry:
    """The live grants of one coordinator instance, bounded by expiry."""

    def __init__(self) -> None:
        # A gateway's threads share one coordinator: the dict and the heap change together.
        self._lock = threading.Lock()
        self._secret = secrets.token_bytes(32)
        # grant id -> (the grant handed out, its parts at mint time)
        self._live: dict[UUID, tuple[ExecutionGrant, tuple[object, ...]]] = {}
        self._expiry_heap: list[tuple[datetime, UUID]] = []
        _LIVE_REGISTRIES.add(self)

    def __len__(self) -> int:
        return len(self._live)

    def _forget(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at fork time
        self._secret = secrets.token_bytes(32)
        self._live.clear()
        self._expiry_heap.clear()

    def _mac(self, *fields: object) -> bytes:
        return hmac.new(self._secret, _message(*fields), hashlib.sha256).digest()  # type: ignore[arg-type]

    def mint(self, grant_id: UUID, identity: LeaseIdentity, connector_id: str, lease_id: UUID,
             epoch: int, scopes: Scopes, expires_at: datetime, correlation_id: str,
             now: datetime) -> ExecutionGrant:
        fields = (grant_id, identity, connector_id, lease_id, epoch, scopes, expires_at,
                  correlation_id)
        grant = ExecutionGrant(*fields, mac=self._mac(*fields))
        with self._lock:
            self._prune_locked(now)
            self._live[grant_id] = (grant, _parts(grant))
            heapq.heappush(self._expiry_heap, (expires_at, grant_id))
        return grant

    def check(self, grant: object) -> Reason | None:
        """``None`` for an unaltered grant this registry minted and still holds.

        A grant that verifies under this registry's secret but was already dropped has
        expired (only expired grants are dropped, and store time does not run backwards),
        so it is ``grant_expired``; anything else is ``grant_unknown``.
        """
        if type(grant) is not ExecutionGrant:
            return Reason.GRANT_UNKNOWN
        # Fast path, every validation of a live grant: the very object handed out, and each
        # of its parts still the very object it was minted with. Identity comparisons cannot
        # be fooled by a look-alike's __eq__ or __str__, and cost a fraction of the HMAC.
        # A hand-built grant's fields may be anything, including objects whose hashing,
        # comparison or attribute access raises: whatever a field does, the answer is
        # ``grant_unknown``, never an exception out of ``validate``. (Catching costs nothing
        # on the path where nothing is raised.)
        try:
            live = self._live.get(grant.grant_id)
            if live is not None and live[0] is grant:
                unaltered = all(map(operator.is_, _parts(grant), live[1]))
                return None if unaltered else Reason.GRANT_UNKNOWN
        except Exception:
            return Reason.GRANT_UNKNOWN
        # Not (or no longer) live: the HMAC tells a dropped, expired grant from one this
        # registry never minted. The MAC covers the fields' text, and a look-alike of
        # another type can print the same text (``str(uuid)`` is the UUID's own text), so
        # the exact types are checked first: then equal text means equal values.
        try:
            if not _well_typed(grant):
                return Reason.GRANT_UNKNOWN
            expected = self._mac(grant.grant_id, grant.identity, grant.connector_id,
                                 grant.lease_id, grant.epoch, grant.scopes, grant.expires_at,
                                 grant.correlation_id)
            authentic = hmac.compare_digest(grant._mac, expected)
        except Exception:
            # Missing fields or a hostile value (a tzinfo whose utcoffset raises, say):
            # hand-built or tampered with, never minted.
            return Reason.GRANT_UNKNOWN
        if not authentic:
            return Reason.GRANT_UNKNOWN
        # Authentic but not the live object: dropped (expired) if no grant with its id is
        # live any more; a live id held by another object means this one is a copy.
        return Reason.GRANT_EXPIRED if grant.grant_id not in self._live else Reason.GRANT_UNKNOWN

    def prune(self, now: datetime) -> None:
        """Drop every grant whose expiry has passed by store time ``now``."""
        # Looked at without the lock first (every validation prunes, and most find nothing
        # due): reading the heap's head is atomic, and it is read again under the lock. It
        # may empty between two reads, hence IndexError rather than a test for emptiness.
        try:
            due = self._expiry_heap[0][0] <= now
        except IndexError:
            return
        if due:
            with self._lock:
                self._prune_locked(now)

    def _prune_locked(self, now: datetime) -> None:
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, grant_id = heapq.heappop(heap)
            self._live.pop(grant_id, None)
