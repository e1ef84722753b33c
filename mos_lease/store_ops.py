"""The store operations a flow yields, and how each is performed on a store.

A flow (:mod:`mos_lease.flows`) never calls its store: it yields one of the values below and
is sent the answer. :func:`store_call` names the one method of the store ports
(:class:`~mos_lease.ports.LeaseStore`, :class:`~mos_lease.ports.AsyncLeaseStore`: the same
names) that answers each operation; :func:`perform` and :func:`perform_async` call it.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar
from uuid import UUID

import attrs

from mos_lease.errors import CommitOutcomeUnknown, MosLeaseError, StoreUnavailable
from mos_lease.identity import LeaseIdentity
from mos_lease.machine import Renew, Write
from mos_lease.ports import AsyncLeaseStore, LeaseStore
from mos_lease.records import AuditEntry

T = TypeVar("T")

# Each operation below is built for one store call and read once, by the driver: plain
# slotted classes, not frozen ones, since a frozen attrs instance costs about twice as much
# to build (every field is set through object.__setattr__) and nothing keeps or hashes them.


@attrs.define(slots=True)
class Load:
    """Read the identity's row and the store's time: answered with a ``Snapshot``."""

    identity: LeaseIdentity


@attrs.define(slots=True)
class Apply:
    """Apply a guarded write with its audit entry, atomically: a ``WriteOutcome``."""

    write: Write
    entry: AuditEntry


@attrs.define(slots=True)
class RenewMany:
    """Apply many renewals in one round trip, each on its own: a ``WriteOutcome`` each."""

    items: tuple[tuple[Renew, AuditEntry], ...]


@attrs.define(slots=True)
class WriteMany:
    """Apply a batch of writes of one kind in one round trip, each on its own: ``method``
    is the store's batch method (``acquire_many``, ``takeover_many``, ``release_many``),
    answered with a ``WriteOutcome`` each."""

    method: str
    items: tuple[tuple[Write, AuditEntry], ...]


@attrs.define(slots=True)
class LoadMany:
    """Read many identities' rows at one store time: answered with a ``Snapshot`` each."""

    identities: tuple[LeaseIdentity, ...]


@attrs.define(slots=True)
class Record:
    """Append an audit entry that changes no row (a refusal, a grant issue); the same entry
    sent again is kept once: answered with ``None``."""

    entry: AuditEntry


@attrs.define(slots=True)
class Committed:
    """Whether the attempt with this event id took effect (its audit row exists with an
    outcome other than ``denied``): a ``bool``."""

    event_id: UUID


Op = Load | Apply | RenewMany | WriteMany | LoadMany | Record | Committed
"""Every store operation a flow may yield."""

Flow = Generator[Op, Any, T]
"""A coordinator operation written as a generator: yields :data:`Op`, returns a ``T``."""

def store_call(op: Op) -> tuple[str, tuple[object, ...]]:
    """The name of the store method that answers ``op`` (the same name on the synchronous
    and the asyncio port, and in telemetry), and its arguments."""
    if isinstance(op, Load):
        return "load", (op.identity,)
    if isinstance(op, Apply):
        return "apply", (op.write, op.entry)
    if isinstance(op, RenewMany):
        return "renew_many", (op.items,)
    if isinstance(op, WriteMany):
        return op.method, (op.items,)
    if isinstance(op, LoadMany):
        return "load_many", (op.identities,)
    if isinstance(op, Record):
        return "record", (op.entry,)
    return "event_committed", (op.event_id,)


def perform(store: LeaseStore, op: Op) -> Any:
    """Call the method of ``store`` that answers ``op`` and return its answer; a batch
    operation the store does not have (:class:`~mos_lease.ports.BatchLeaseStore` is
    optional) is made of its single calls (:func:`one_by_one`)."""
    name, args = store_call(op)
    method = getattr(store, name, None)
    if method is None:
        return _drive_sync(store, one_by_one(op))
    return method(*args)


async def perform_async(store: AsyncLeaseStore, op: Op) -> Any:
    """As :func:`perform`, on an asyncio store."""
    name, args = store_call(op)
    method = getattr(store, name, None)
    if method is None:
        return await _drive_async(store, one_by_one(op))
    return await method(*args)


def one_by_one(op: Op) -> Generator[Load | Apply, Any, list[Any]]:
    """A batch operation (``WriteMany``, ``LoadMany``) as the single calls it stands for, for
    a store without its batch method. A write that fails after others of the batch were
    applied raises :class:`~mos_lease.errors.CommitOutcomeUnknown`, not the store's error:
    the batch is then settled item by item, as a lost batch is."""
    if isinstance(op, LoadMany):
        snapshots = []
        for identity in op.identities:
            snapshots.append((yield Load(identity)))
        return snapshots
    if not isinstance(op, WriteMany):
        raise TypeError(f"{type(op).__name__} is not a batch operation")
    outcomes = []
    for write, entry in op.items:
        try:
            outcomes.append((yield Apply(write, entry)))
        except StoreUnavailable as error:
            if not outcomes:
                raise
            raise CommitOutcomeUnknown(entry.event_id, f"batch cut short: {error}") from error
    return outcomes


def _drive_sync(store: LeaseStore, calls: Generator[Load | Apply, Any, T]) -> T:
    answer: Any = None
    failure: MosLeaseError | None = None
    while True:
        try:
            step = calls.send(answer) if failure is None else calls.throw(failure)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            answer, failure = perform(store, step), None
        except MosLeaseError as error:
            answer, failure = None, error


async def _drive_async(store: AsyncLeaseStore, calls: Generator[Load | Apply, Any, T]) -> T:
    answer: Any = None
    failure: MosLeaseError | None = None
    while True:
        try:
            step = calls.send(answer) if failure is None else calls.throw(failure)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            answer, failure = await perform_async(store, step), None
        except MosLeaseError as error:
            answer, failure = None, error
