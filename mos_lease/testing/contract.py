"""The write-guard contract every :class:`~mos_lease.ports.LeaseStore` must meet.

Each guarded write is applied to the store and compared with the reference semantics,
:func:`mos_lease.machine.write_outcome`, evaluated on the row read just before and at the
time the store reports for the write. The audit row must appear exactly when the write
applied, stamped with the write's time. Holder metadata is part of the row: an insert sets
it, a takeover replaces it (with none, too), a renewal and a release keep it
(:func:`_metadata_case`, and the random writes carry some).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import timedelta
from uuid import UUID, uuid4

from mos_lease.errors import InvalidInput
from mos_lease.identity import MAX_EPOCH, LeaseIdentity
from mos_lease.ids import uuid7
from mos_lease.machine import Close, Insert, Renew, Rotate, Write, write_outcome
from mos_lease.metadata import EMPTY_METADATA, Metadata
from mos_lease.ports import LeaseStore
from mos_lease.records import AuditEntry
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
        assert store.event_committed(entry.event_id) == (reference is not None), \
            f"step {step}: audit row presence does not match the write"
        if reference is not None:
            record = store.audit(identity, limit=100_000)[-1]
            assert record.entry == entry and record.recorded_at == outcome.now
            current[identity] = (reference.connector_id, reference.lease_id, reference.epoch)
        if rng.random() < 0.15:
            harness.advance(timedelta(seconds=rng.choice([3, 31])))

    # Refusals and grant issues are appended as they are.
    refusal = AuditEntry(uuid7(), LifecycleEvent.GRANT_VALIDATE, Outcome.DENIED, None,
                         identities[0], "c1", 3, "contract")
    store.record(refusal)
    assert store.event_committed(refusal.event_id)
    assert store.audit(identities[0], limit=100_000)[-1].entry == refusal
    assert not store.event_committed(uuid4())
    _record_many_case(store, identities)


def _record_many_case(store: InspectableStore, identities: list[LeaseIdentity]) -> None:
    """``record_many``: each entry appended as ``record`` appends it, in the order given,
    stamped with the store's time; bad input refused before anything is written."""
    batch = [AuditEntry(uuid7(), LifecycleEvent.GRANT_ISSUE, Outcome.GRANT_ISSUED, None,
                        identities[i % len(identities)], "c1", i + 1, f"contract-many-{i}")
             for i in range(4)]
    batch.append(AuditEntry(uuid7(), LifecycleEvent.GRANT_ISSUE, Outcome.DENIED,
                            Reason.STALE_EPOCH, identities[0], "c2", None, "contract-many"))
    before = store.load(identities[0]).now
    store.record_many(batch)
    after = store.load(identities[0]).now
    wanted = {e.event_id for e in batch}
    written = [r for r in store.audit(limit=100_000) if r.entry.event_id in wanted]
    assert [r.entry for r in written] == batch, f"record_many appended {written}"
    assert all(before <= r.recorded_at <= after for r in written), \
        "record_many: a stamp outside the call"
    again = AuditEntry(uuid7(), LifecycleEvent.GRANT_ISSUE, Outcome.GRANT_ISSUED, None,
                       identities[1], "c1", 1, "contract-twice")
    for bad in ([again, again], again, ["not an entry"]):
        try:
            store.record_many(bad)  # type: ignore[arg-type]
        except InvalidInput:
            pass
        else:
            raise AssertionError(f"record_many accepted {bad!r}")
    assert not store.event_committed(again.event_id), "record_many wrote refused input"
