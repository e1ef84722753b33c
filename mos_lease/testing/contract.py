"""The write-guard contract every :class:`~mos_lease.ports.LeaseStore` must meet.

Each guarded write is applied to the store and compared with the reference semantics,
:func:`mos_lease.machine.write_outcome`, evaluated on the row read just before and at the
time the store reports for the write. The audit row must appear exactly when the write
applied, stamped with the write's time. Reconciling answers whether an attempt took effect:
a refused write whose refusal was recorded under its event id (as the coordinator records
it) is not committed, a grant issue's row is, and the same record sent twice (after a lost
reply) is kept once (:func:`_reconcile_case`, and every refused random write). Holder
metadata is part of the row: an insert sets it, a takeover replaces it (with none, too), a
renewal and a release keep it (:func:`_metadata_case`, and the random writes carry some). A
store with the batch operations (:class:`~mos_lease.ports.BatchLeaseStore`) has each item of
a mixed batch checked the same way (:func:`_batch_case`). A batch of renewals is judged
lease by lease, and a row another transaction holds is reported not reached
(:func:`_renewal_batch_case`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import cast
from uuid import UUID, uuid4

import attrs

from mos_lease.identity import MAX_EPOCH, LeaseIdentity
from mos_lease.ids import uuid7
from mos_lease.machine import (
    Close,
    Insert,
    Renew,
    Rotate,
    Write,
    write_outcome,
    written_epoch,
)
from mos_lease.metadata import EMPTY_METADATA, Metadata
from mos_lease.ports import BATCH_METHODS, BatchLeaseStore, LeaseStore
from mos_lease.records import AuditEntry, LeaseRow
from mos_lease.testing.harness import InspectableStore, StoreHarness
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason

_EVENTS: dict[type[Write], tuple[LifecycleEvent, Outcome]] = {
    Insert: (LifecycleEvent.ACQUIRE, Outcome.ACQUIRED),
    Renew: (LifecycleEvent.HEARTBEAT, Outcome.RENEWED),
    Close: (LifecycleEvent.RELEASE, Outcome.RELEASED),
    Rotate: (LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER),
}


def _entry(write: Write, connector_id: str) -> AuditEntry:
    event, outcome = _EVENTS[type(write)]
    return AuditEntry(uuid7(), event, outcome, None, write.identity, connector_id, None,
                      "contract")


def _refusal(entry: AuditEntry) -> AuditEntry:
    """The audit entry the coordinator records for a refused write: the write's event id,
    outcome ``denied``."""
    return attrs.evolve(entry, outcome=Outcome.DENIED, reason=Reason.LEASE_REPLACED)


def _reconcile_case(store: InspectableStore, identity: LeaseIdentity) -> None:
    """``event_committed`` answers from the attempt's outcome, and a resent record is kept
    once, on one fresh identity."""
    ttl = timedelta(seconds=30)
    held = Insert(identity, uuid4(), "c1", (), ttl)
    assert store.apply(held, _entry(held, "c1")).row is not None, "reconcile case: insert"
    refused = Insert(identity, uuid4(), "c2", (), ttl)  # the lease is held: refused
    entry = _entry(refused, "c2")
    assert store.apply(refused, entry).row is None, "reconcile case: second insert applied"
    refusal = _refusal(entry)
    store.record(refusal)
    store.record(refusal)  # the same record sent again after its reply was lost
    assert not store.event_committed(entry.event_id), \
        "reconcile case: a refused write whose refusal row exists reconciles as committed"
    recorded = [r.entry for r in store.audit(identity, limit=100_000)
                if r.entry.event_id == entry.event_id]
    assert recorded == [refusal], f"reconcile case: a resent record left {recorded}"
    grant = AuditEntry(uuid7(), LifecycleEvent.GRANT_ISSUE, Outcome.GRANT_ISSUED, None,
                       identity, "c1", 1, "contract")
    store.record(grant)
    assert store.event_committed(grant.event_id), \
        "reconcile case: a recorded grant issue reconciles as not committed"


# Payloads the writes carry: none, ASCII, and non-ASCII text with a space and quotes, which
# a store must hand back as it was given.
_METADATA = (EMPTY_METADATA, Metadata({"endpoint": "10.0.0.7:8443"}),
             Metadata({"endpoint": "gw-2:9000", "zone": 'eu "west" ü'}))


def _random_write(rng: random.Random, identity: LeaseIdentity, current: tuple[str, UUID, int],
                  ) -> Write:
    connector, lease_id, epoch = current
    # Mostly plausible writes, sometimes a field off by one: both sides of every guard.
    if rng.random() < 0.3:
        connector = rng.choice(["c1", "c2"])
    if rng.random() < 0.2:
        lease_id = uuid4()
    if rng.random() < 0.2:
        epoch = max(1, epoch + rng.choice([-1, 1]))
    ttl = timedelta(seconds=rng.choice([5.5, 30.5]))
    kind = rng.choice(["insert", "renew", "close", "rotate", "rotate"])
    if kind == "insert":
        return Insert(identity, uuid4(), connector, ("a",), ttl, rng.choice(_METADATA))
    if kind == "renew":
        return Renew(identity, connector, lease_id, epoch, ttl)
    if kind == "close":
        return Close(identity, connector, lease_id, epoch)
    return Rotate(identity, epoch, rng.random() < 0.5, uuid4(), connector, ("a", "b"), ttl,
                  rng.choice(_METADATA))


def _metadata_case(store: LeaseStore, identity: LeaseIdentity) -> None:
    """Holder metadata set, kept and replaced, step by step on one fresh identity."""
    ttl = timedelta(seconds=30)
    first, second = _METADATA[1], _METADATA[2]

    def applied(write: Write, expected: Metadata) -> tuple[UUID, int]:
        row = store.apply(write, _entry(write, write.connector_id)).row
        assert row is not None, f"metadata case: {write} was refused"
        assert row.metadata == expected, f"metadata case: {write} left {row.metadata!r}"
        loaded = store.load(identity).row
        assert loaded is not None and loaded.metadata == expected, \
            f"metadata case: after {write} the row reads {loaded!r}"
        return row.lease_id, row.epoch

    lease_id, epoch = applied(Insert(identity, uuid4(), "c1", (), ttl, first), first)
    applied(Renew(identity, "c1", lease_id, epoch, ttl), first)  # a heartbeat keeps it
    lease_id, epoch = applied(Rotate(identity, epoch, True, uuid4(), "c2", (), ttl, second),
                              second)  # a takeover replaces it
    applied(Close(identity, "c2", lease_id, epoch), second)  # the released row still shows it
    applied(Rotate(identity, epoch, False, uuid4(), "c3", (), ttl), EMPTY_METADATA)


def _batch_entry(write: Write) -> AuditEntry:
    # A batch's audit entry names the epoch the row is left at (stores may check it).
    event, outcome = _EVENTS[type(write)]
    return AuditEntry(uuid7(), event, outcome, None, write.identity, write.connector_id,
                      written_epoch(write), "contract-batch")


def _batch(store: BatchLeaseStore, method: str, writes: list[Write]) -> list[LeaseRow | None]:
    """One batch through ``method``, each outcome checked against the reference semantics on
    the row read just before, at the time the store reports for it."""
    keys = [write.identity for write in writes]
    before = list(store.load_many(keys))
    assert [s.row for s in before] == [store.load(key).row for key in keys], \
        "load_many disagrees with load"
    entries = [_batch_entry(write) for write in writes]
    outcomes = list(getattr(store, method)(list(zip(writes, entries, strict=True))))
    assert len(outcomes) == len(writes), f"{method}: {len(outcomes)} outcomes"
    rows: list[LeaseRow | None] = []
    for write, entry, read, outcome in zip(writes, entries, before, outcomes, strict=True):
        assert outcome.reached, f"{method}: {write} not reached, with no other transaction"
        reference = write_outcome(write, read.row, outcome.now)
        assert outcome.row == reference, f"{method}: {write} gave {outcome.row}, " \
                                         f"reference {reference}"
        assert outcome.found is None or outcome.row is not None or \
            outcome.found.row == read.row, f"{method}: {write} found {outcome.found}"
        assert store.load(write.identity).row == (reference if reference is not None
                                                  else read.row)
        assert store.event_committed(entry.event_id) == (reference is not None), \
            f"{method}: audit row presence does not match {write}"
        rows.append(reference)
    return rows


def _batch_case(harness: StoreHarness, run: str) -> None:
    """The optional batch operations (:class:`~mos_lease.ports.BatchLeaseStore`), if the
    store has them: mixed batches where each item applies or is refused on its own."""
    if not all(hasattr(harness.store, name) for name in BATCH_METHODS):
        return
    store = cast(BatchLeaseStore, harness.store)
    k = [LeaseIdentity(f"contract-{run}", "agent", f"batch{i}") for i in range(6)]
    ttl = timedelta(seconds=30)
    made = _batch(store, "acquire_many", [Insert(key, uuid4(), "c1", ("a",), ttl,
                                                  _METADATA[i % 3])
                                           for i, key in enumerate(k[:4])])
    assert all(row is not None for row in made), "acquire_many refused a fresh identity"
    again = _batch(store, "acquire_many", [Insert(k[0], uuid4(), "c2", (), ttl),
                                           Insert(k[4], uuid4(), "c2", (), ttl)])
    assert again[0] is None and again[1] is not None
    taken = _batch(store, "takeover_many", [
        Rotate(k[0], 1, True, uuid4(), "c2", ("a", "b"), ttl, _METADATA[1]),
        Rotate(k[1], 2, True, uuid4(), "c2", (), ttl),
        Rotate(k[2], 1, False, uuid4(), "c2", (), ttl),
        Rotate(k[5], 1, True, uuid4(), "c2", (), ttl)])
    assert [row is not None for row in taken] == [True, False, False, False]
    first, fourth, fifth = taken[0], made[3], again[1]
    assert first is not None and fourth is not None and fifth is not None
    released = _batch(store, "release_many", [
        Close(k[0], "c2", first.lease_id, 2), Close(k[3], "c1", uuid4(), 1),
        Close(k[4], "c2", fifth.lease_id, 1)])
    assert [row is not None for row in released] == [True, False, True]
    harness.advance(ttl + timedelta(seconds=1))
    late = _batch(store, "takeover_many", [
        Rotate(k[3], 1, False, uuid4(), "c3", (), ttl), Rotate(k[4], 1, False, uuid4(), "c3",
                                                               (), ttl)])
    assert all(row is not None and row.epoch == 2 for row in late)
    assert list(store.load_many([])) == []


def _renewal(identity: LeaseIdentity, lease_id: UUID, epoch: int,
             ttl: timedelta) -> tuple[Renew, AuditEntry]:
    # A batch's entries are the coordinator's: the renewed heartbeat at the lease's epoch.
    return (Renew(identity, "c1", lease_id, epoch, ttl),
            AuditEntry(uuid7(), LifecycleEvent.HEARTBEAT, Outcome.RENEWED, None, identity,
                       "c1", epoch, "contract"))


def _renewal_batch_case(harness: StoreHarness, run: str) -> None:
    """A batch of renewals (``renew_many``): each judged as ``apply`` would judge it alone,
    at the batch's time, and audited on its own; a refused one does not affect the others;
    the outcomes come back in order. Nothing else holds a row here, so every renewal must be
    reached (``WriteOutcome.reached``). A harness that can hold a row from another
    transaction (an optional ``hold_row(identity)`` context manager: PostgreSQL's) also
    shows that the batch renews the others at once and reports the held one not reached,
    having written and audited nothing for it."""
    store = harness.store
    ttl = timedelta(seconds=30)
    identities = [LeaseIdentity(f"contract-{run}", "agent", f"batch-{i}") for i in range(4)]
    leases: list[tuple[UUID, int]] = []
    for identity in identities[:3]:
        insert = Insert(identity, uuid4(), "c1", (), ttl)
        row = store.apply(insert, _entry(insert, "c1")).row
        assert row is not None, f"batch case: {insert} was refused"
        leases.append((row.lease_id, row.epoch))
    renewals = [_renewal(identities[0], *leases[0], ttl),
                _renewal(identities[1], uuid4(), leases[1][1], ttl),  # another lease id
                _renewal(identities[2], *leases[2], ttl),
                _renewal(identities[3], uuid4(), 1, ttl)]  # no row at all
    before = [store.load(identity).row for identity in identities]
    outcomes = list(store.renew_many(renewals))
    assert len(outcomes) == len(renewals), f"batch case: {len(outcomes)} outcomes"
    for (write, entry), row, outcome in zip(renewals, before, outcomes, strict=True):
        assert outcome.reached, f"batch case: {write} not reached, with no row held"
        reference = write_outcome(write, row, outcome.now)
        assert outcome.row == reference, f"batch case: {write} gave {outcome.row}, " \
                                         f"reference {reference}"
        assert store.event_committed(entry.event_id) == (reference is not None), \
            f"batch case: audit row presence does not match {write}"
    hold_row: Callable[[LeaseIdentity], AbstractContextManager[object]] | None = getattr(
        harness, "hold_row", None)
    if hold_row is None:
        return
    held = store.load(identities[2]).row
    assert held is not None
    renewals = [_renewal(identities[0], *leases[0], ttl),
                _renewal(identities[2], held.lease_id, held.epoch, ttl)]
    with hold_row(identities[2]):
        renewed, skipped = store.renew_many(renewals)
    assert renewed.reached and renewed.row is not None, f"batch case: {renewed}"
    assert not skipped.reached and skipped.row is None, f"batch case: held row {skipped}"
    assert not store.event_committed(renewals[1][1].event_id), \
        "batch case: a renewal not reached was audited"
    assert store.load(identities[2]).row == held, "batch case: a row not reached changed"


def run_store_contract(harness_factory: Callable[[], StoreHarness], *, steps: int = 300,
                       seed: int = 0) -> None:
    """Raise ``AssertionError`` at the first step where the store departs from the contract."""
    harness = harness_factory()
    store = harness.store
    rng = random.Random(seed)
    run = uuid4().hex[:12]
    identities = [LeaseIdentity(f"contract-{run}", "agent", f"b{i}") for i in range(3)]
    current = {identity: ("c1", uuid4(), 1) for identity in identities}
    _metadata_case(store, LeaseIdentity(f"contract-{run}", "agent", "metadata"))
    _batch_case(harness, run)
    _renewal_batch_case(harness, run)
    _reconcile_case(store, LeaseIdentity(f"contract-{run}", "agent", "reconcile"))

    # The bigint ceiling: a takeover at MAX_EPOCH must be refused, never wrap.
    assert not write_outcome(
        Rotate(identities[0], MAX_EPOCH, True, uuid4(), "c1", (), timedelta(seconds=1)),
        None, store.load(identities[0]).now)

    for step in range(steps):
        identity = rng.choice(identities)
        write = _random_write(rng, identity, current[identity])
        before = store.load(identity)
        entry = _entry(write, write.connector_id)
        outcome = store.apply(write, entry)
        assert outcome.now >= before.now, f"step {step}: store time went backwards"
        reference = write_outcome(write, before.row, outcome.now)
        assert outcome.row == reference, f"step {step}: {write} gave {outcome.row}, " \
                                         f"reference {reference}"
        after = store.load(identity)
        assert after.row == (reference if reference is not None else before.row)
        if reference is None:
            store.record(_refusal(entry))  # as the coordinator records a refusal
        assert store.event_committed(entry.event_id) == (reference is not None), \
            f"step {step}: reconciling the write does not match whether it applied"
        if reference is not None:
            record = store.audit(identity, limit=100_000)[-1]
            assert record.entry == entry and record.recorded_at == outcome.now
            current[identity] = (reference.connector_id, reference.lease_id, reference.epoch)
        if rng.random() < 0.15:
            harness.advance(timedelta(seconds=rng.choice([3, 31])))

    # Refusals and grant issues are appended as they are; a refusal changed nothing.
    refusal = AuditEntry(uuid7(), LifecycleEvent.GRANT_VALIDATE, Outcome.DENIED, None,
                         identities[0], "c1", 3, "contract")
    store.record(refusal)
    assert not store.event_committed(refusal.event_id)
    assert store.audit(identities[0], limit=100_000)[-1].entry == refusal
    assert not store.event_committed(uuid4())
