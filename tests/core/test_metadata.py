"""Holder metadata on the in-memory store: its checks (bad input raises InvalidInput naming
the field and writes nothing), set by acquire and takeover, kept by heartbeat and release,
replaced by a takeover, shown by current_holder() and a refused acquire, never audited; and
hold(), the keepers and the supervisor pass it on."""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any
from uuid import uuid4

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseIdentity,
    Supervisor,
    hold,
)
from mos_lease.clock import ManualClock
from mos_lease.ids import uuid7
from mos_lease.keeper import AsyncLeaseKeeper, LeaseKeeper
from mos_lease.machine import Insert, Renew, Rotate, Write
from mos_lease.metadata import (
    EMPTY_METADATA,
    MAX_METADATA_BYTES,
    Metadata,
    check_metadata,
    stored_metadata,
)
from mos_lease.records import AuditEntry, LeaseHandle, LeaseRow, WriteOutcome
from mos_lease.results import HolderView
from mos_lease.testing import run_store_contract
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore, MemoryHarness

IDENT = LeaseIdentity("acme", "agent-1", "binding-1")
ROUTE = {"endpoint": "10.0.0.7:8443", "zone": "eu-west"}


def _coordinator() -> tuple[ConnectorLeaseCoordinator, InMemoryLeaseStore, ManualClock]:
    clock = ManualClock()
    store = InMemoryLeaseStore(clock)
    return ConnectorLeaseCoordinator(store, AllowAllPolicy()), store, clock


# -- the checks ------------------------------------------------------------------------------


class _Subclass(str):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__


GOOD: list[Mapping[str, str]] = [
    {}, {"a": ""}, {"endpoint": "10.0.0.7:8443"}, MappingProxyType({"k": "v"}),
    {f"k{i}": "v" for i in range(16)}, {"k" * 64: "v" * 512},
    {"key.with_all-chars": "any printable text: ü, 東京, spaces, \"quotes\" and \\"},
    # 2,048 bytes exactly: four keys of 2 characters and values of 510 bytes.
    {f"k{i}": "x" * 510 for i in range(4)},
]


@pytest.mark.parametrize("value", GOOD)
def test_good_metadata_is_kept_as_given(value: Mapping[str, str]) -> None:
    checked = check_metadata("metadata", value)
    assert checked == value and dict(checked) == dict(value)
    assert isinstance(checked, Metadata)


def test_str_subclasses_become_plain_strings() -> None:
    checked = check_metadata("metadata", {_Subclass("key"): _Subclass("value")})
    assert [type(k) for k in checked] == [str] and type(checked["key"]) is str


BAD: list[tuple[object, str, str]] = [
    (["endpoint", "x"], "metadata", "mapping of str to str, not list"),
    ("endpoint=x", "metadata", "not str"),
    (b"endpoint", "metadata", "not bytes"),
    (42, "metadata", "not int"),
    ({b"endpoint": "x"}, "metadata", "keys must be str, not bytes"),
    ({1: "x"}, "metadata", "keys must be str, not int"),
    ({"endpoint": b"x"}, "metadata['endpoint']", "must be a str, not bytes"),
    ({"endpoint": 8443}, "metadata['endpoint']", "must be a str, not int"),
    ({"endpoint": None}, "metadata['endpoint']", "must be a str, not NoneType"),
    ({"": "x"}, "metadata", "1 to 64 characters"),
    ({"k" * 65: "x"}, "metadata", "1 to 64 characters"),
    ({"end point": "x"}, "metadata", "does not match"),
    ({"ключ": "x"}, "metadata", "does not match"),
    ({"k": "v" * 513}, "metadata['k']", "at most 512 characters"),
    ({"k": "a\x00b"}, "metadata['k']", "printable"),
    ({"k": "line\nbreak"}, "metadata['k']", "printable"),
    ({"k": "\u202eevil"}, "metadata['k']", "printable"),
    ({"k": "\ud800"}, "metadata['k']", "printable"),
    ({f"k{i}": "v" for i in range(17)}, "metadata", "at most 16 entries"),
    # 2,049 bytes: the last value one byte over.
    ({**{f"k{i}": "x" * 510 for i in range(3)}, "k3": "x" * 511}, "metadata",
     f"at most {MAX_METADATA_BYTES} bytes"),
    # Under 512 characters each, but multi-byte: 5 values of 200 three-byte characters.
    ({f"k{i}": "東" * 200 for i in range(5)}, "metadata", "bytes of UTF-8"),
]


@pytest.mark.parametrize(("value", "field", "message"), BAD)
def test_bad_metadata_is_refused_naming_the_field(value: object, field: str,
                                                 message: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        check_metadata("metadata", value)
    assert refused.value.field == field
    assert message in refused.value.message


class _Endless(Mapping[str, str]):
    """A mapping that claims a small length but yields keys without end."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, key: str) -> str:
        return "v"

    def __iter__(self) -> Any:
        n = 0
        while True:
            n += 1
            yield f"k{n}"


def test_a_mapping_that_lies_about_its_length_is_read_only_past_the_bound() -> None:
    with pytest.raises(InvalidInput, match="at most 16 entries"):
        check_metadata("metadata", _Endless())


@pytest.mark.parametrize(("value", "field", "message"), BAD)
def test_bad_metadata_writes_nothing_on_acquire_and_takeover(value: object, field: str,
                                                             message: str) -> None:
    gateway, store, clock = _coordinator()
    with pytest.raises(InvalidInput) as refused:
        gateway.acquire(IDENT, "c1", scopes=[], ttl=10, metadata=value)  # type: ignore[arg-type]
    assert refused.value.field == field
    assert store.leases() == [] and store.audit() == []
    assert gateway.acquire(IDENT, "c1", scopes=[], ttl=10, metadata=ROUTE).ok
    clock.advance(timedelta(seconds=11))
    before = (store.leases(), store.audit())
    with pytest.raises(InvalidInput) as refused:
        gateway.takeover(IDENT, "c2", scopes=[], ttl=10, expected_epoch=1,
                         metadata=value)  # type: ignore[arg-type]
    assert refused.value.field == field
    assert (store.leases(), store.audit()) == before


# -- the value -------------------------------------------------------------------------------


def test_metadata_is_read_only_hashable_and_picklable() -> None:
    checked = check_metadata("metadata", ROUTE)
    with pytest.raises(TypeError):
        checked["endpoint"] = "elsewhere"  # type: ignore[index]
    with pytest.raises(AttributeError):
        checked._items = {}
    assert hash(checked) == hash(check_metadata("metadata", dict(reversed(ROUTE.items()))))
    assert pickle.loads(pickle.dumps(checked)) == checked
    assert Metadata() == {} and Metadata({}) == EMPTY_METADATA and checked != {}
    # The caller's dict is copied: changing it afterwards changes nothing kept.
    given = dict(ROUTE)
    kept = check_metadata("metadata", given)
    given["endpoint"] = "changed"
    assert kept["endpoint"] == ROUTE["endpoint"]


def test_a_hand_built_view_keeps_its_metadata_read_only() -> None:
    view = HolderView("c1", 1, None, None, None, metadata={"a": "b"})  # type: ignore[arg-type]
    assert isinstance(view.metadata, Metadata)
    with pytest.raises(TypeError):
        view.metadata["a"] = "c"  # type: ignore[index]


# -- the lifecycle -------------------------------------------------------------------------


def test_acquire_sets_heartbeat_and_release_keep_takeover_replaces() -> None:
    gateway, store, clock = _coordinator()
    acquired = gateway.acquire(IDENT, "c1", scopes=[], ttl=10, metadata=ROUTE)
    assert acquired.lease is not None
    view = gateway.current_holder(IDENT)
    assert view is not None and view.metadata == ROUTE
    with pytest.raises(TypeError):
        view.metadata["endpoint"] = "elsewhere"  # type: ignore[index]
    refused = gateway.acquire(IDENT, "c2", scopes=[], ttl=10, metadata={"endpoint": "other"})
    assert not refused.ok and refused.holder is not None
    assert refused.holder.metadata == ROUTE  # the holder's, not the refused caller's
    assert gateway.heartbeat(acquired.lease, ttl=10).ok
    assert gateway.heartbeat_many([acquired.lease], ttl=10)[0].ok
    assert gateway.current_holder(IDENT).metadata == ROUTE  # type: ignore[union-attr]
    assert gateway.release(acquired.lease).ok
    released = gateway.current_holder(IDENT)
    assert released is not None and released.metadata == ROUTE  # who held it
    taken = gateway.takeover(IDENT, "c2", scopes=[], ttl=10, expected_epoch=1,
                             metadata={"endpoint": "10.0.0.8:8443"})
    assert taken.lease is not None
    assert gateway.current_holder(IDENT).metadata == {  # type: ignore[union-attr]
        "endpoint": "10.0.0.8:8443"}
    clock.advance(timedelta(seconds=11))
    observed = gateway.current_holder(IDENT)
    assert gateway.takeover(IDENT, "c3", scopes=[], ttl=10, expected_epoch=2,
                            observed=observed).ok
    assert gateway.current_holder(IDENT).metadata == {}  # type: ignore[union-attr]
    assert store.leases()[0].metadata is EMPTY_METADATA


def test_metadata_never_reaches_the_audit_log() -> None:
    gateway, store, _ = _coordinator()
    marker = "route-marker-7f3a"
    acquired = gateway.acquire(IDENT, "c1", scopes=[], ttl=10, metadata={"endpoint": marker})
    assert acquired.lease is not None
    assert not gateway.acquire(IDENT, "c2", scopes=[], ttl=10, metadata={"e": marker}).ok
    assert gateway.takeover(IDENT, "c2", scopes=[], ttl=10, expected_epoch=1,
                            metadata={"endpoint": marker}).ok  # AllowAll lets it preempt
    records = store.audit()
    assert len(records) == 3
    assert all(marker not in repr(record) for record in records)
    assert "metadata" not in {f.name for f in attrs.fields(AuditEntry)}


def test_the_async_coordinator_takes_metadata_too() -> None:
    async def main() -> None:
        gateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
        assert (await gateway.acquire(IDENT, "c1", scopes=[], ttl=10, metadata=ROUTE)).ok
        view = await gateway.current_holder(IDENT)
        assert view is not None and view.metadata == ROUTE
        with pytest.raises(InvalidInput, match="metadata"):
            await gateway.takeover(IDENT, "c2", scopes=[], ttl=10, expected_epoch=1,
                                   metadata={"k": 1})  # type: ignore[dict-item]

    asyncio.run(main())


# -- the shells that acquire for a gateway -------------------------------------------------


def test_hold_sets_metadata_and_checks_it_before_anything_is_written() -> None:
    gateway, store, _ = _coordinator()
    with pytest.raises(InvalidInput) as refused:
        hold(gateway, IDENT, "c1", scopes=[], ttl=10,
             metadata=["endpoint"])  # type: ignore[call-overload]
    assert refused.value.field == "metadata" and store.audit() == []
    with hold(gateway, IDENT, "c1", scopes=[], ttl=10, wait=0, metadata=ROUTE):
        assert gateway.current_holder(IDENT).metadata == ROUTE  # type: ignore[union-attr]
    assert gateway.current_holder(IDENT).metadata == ROUTE  # type: ignore[union-attr]
    # The next holder's wait takes the released lease over, with its own metadata.
    with hold(gateway, IDENT, "c2", scopes=[], ttl=10, wait=0, metadata={"endpoint": "b:1"}):
        view = gateway.current_holder(IDENT)
        assert view is not None and view.epoch == 2 and view.metadata == {"endpoint": "b:1"}


def test_the_keepers_pass_metadata_to_their_acquire_and_takeover() -> None:
    gateway, _, _ = _coordinator()
    keeper = LeaseKeeper(gateway, ttl=10)
    try:
        assert keeper.acquire(IDENT, "c1", scopes=[], metadata=ROUTE).ok
        assert gateway.current_holder(IDENT).metadata == ROUTE  # type: ignore[union-attr]
    finally:
        keeper.stop(release=True)
    second = LeaseKeeper(gateway, ttl=10)
    try:
        assert second.takeover(IDENT, "c2", scopes=[], expected_epoch=1,
                               metadata={"endpoint": "b:1"}).ok
        assert gateway.current_holder(IDENT).metadata == {  # type: ignore[union-attr]
            "endpoint": "b:1"}
    finally:
        second.stop(release=True)

    async def main() -> None:
        agateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
        akeeper = AsyncLeaseKeeper(agateway, ttl=10)
        try:
            assert (await akeeper.acquire(IDENT, "c1", scopes=[], metadata=ROUTE)).ok
            view = await agateway.current_holder(IDENT)
            assert view is not None and view.metadata == ROUTE
        finally:
            await akeeper.stop(release=True)

    asyncio.run(main())


def test_the_supervisor_sets_each_bindings_metadata() -> None:
    gateway, _, _ = _coordinator()
    other = LeaseIdentity("acme", "agent-2", "binding-1")
    supervisor = Supervisor(gateway, background=False)
    try:
        with pytest.raises(InvalidInput) as refused:
            supervisor.add(IDENT, "c1", scopes=[], ttl=10,
                           metadata={"endpoint": 1})  # type: ignore[dict-item]
        assert refused.value.field == "metadata['endpoint']"
        supervisor.add(IDENT, "c1", scopes=[], ttl=10, metadata=ROUTE)
        supervisor.add(other, "c1", scopes=[], ttl=10)
        for _ in range(4):
            supervisor.turn()
        assert gateway.current_holder(IDENT).metadata == ROUTE  # type: ignore[union-attr]
        assert gateway.current_holder(other).metadata == {}  # type: ignore[union-attr]
    finally:
        supervisor.close()


# -- the conformance kit catches a store that loses metadata -------------------------------


def _flawed(flaw: str) -> type[InMemoryLeaseStore]:
    class Flawed(InMemoryLeaseStore):
        def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
            outcome = super().apply(write, entry)
            row = outcome.row
            if row is None:
                return outcome
            bad: LeaseRow | None = None
            if flaw == "renewal_drops" and isinstance(write, Renew) and row.metadata:
                bad = attrs.evolve(row, metadata=EMPTY_METADATA)
            elif flaw == "takeover_keeps" and isinstance(write, Rotate) and not write.metadata:
                before = outcome.found.row if outcome.found is not None else None
                bad = attrs.evolve(row, metadata=before.metadata if before else Metadata(
                    {"endpoint": "stale"}))
            elif flaw == "insert_ignores" and isinstance(write, Insert) and write.metadata:
                bad = attrs.evolve(row, metadata=EMPTY_METADATA)
            if bad is None:
                return outcome
            with self._lock:
                self._rows[write.identity] = bad
            return attrs.evolve(outcome, row=bad)

    return Flawed


@pytest.mark.parametrize("flaw", ["renewal_drops", "takeover_keeps", "insert_ignores"])
def test_the_contract_catches_a_store_that_loses_metadata(flaw: str) -> None:
    class Harness(MemoryHarness):
        def __init__(self) -> None:
            super().__init__()
            self._store = _flawed(flaw)(self.clock)

    with pytest.raises(AssertionError, match="metadata"):
        run_store_contract(Harness, steps=50)
    run_store_contract(MemoryHarness, steps=50)  # the same kit passes the reference store


# -- metadata the library refuses, written around it, is withheld on the way out -------------

# Each could only come from a write built by hand around the coordinator's checks (on
# PostgreSQL: SQL run as the gateway role; tests/pg/test_pg_metadata_rules.py).
PLANTED: list[object] = [
    {"endpoint": 8443},
    {"endpoint": {"host": "10.0.0.7"}},
    {"endpoint": "\x1b[2J\x1b[31mowned\x1b[0m"},
    {"\x1b]0;owned\x07": "10.0.0.7:8443"},
    {"end point": "10.0.0.7:8443"},
    {f"k{i}": "v" for i in range(17)},
]


def _planted(store: InMemoryLeaseStore, value: object,
             ident: LeaseIdentity = IDENT) -> WriteOutcome:
    write = Insert(ident, uuid4(), "c1", ("tool:run",), timedelta(seconds=10),
                   Metadata(value))  # type: ignore[arg-type]
    entry = AuditEntry(event_id=uuid7(), event=LifecycleEvent.ACQUIRE,
                       outcome=Outcome.ACQUIRED, reason=None, identity=ident,
                       connector_id="c1", epoch=1, correlation_id="planted")
    return store.apply(write, entry)


@pytest.mark.parametrize("value", PLANTED, ids=repr)
def test_every_read_of_the_memory_store_withholds_planted_metadata(value: object) -> None:
    gateway, store, _ = _coordinator()
    applied = _planted(store, value)
    seen = store.holding(IDENT, lambda snapshot: snapshot.row)
    refused = gateway.acquire(IDENT, "c2", scopes=[], ttl=10, metadata=ROUTE)
    assert not refused.ok
    shown = [applied.row, store.load(IDENT).row, seen, *store.leases(),
             gateway.current_holder(IDENT), refused.holder]
    assert len(shown) == 6
    for item in shown:
        assert item is not None and item.metadata == {} and item.metadata_invalid, item


@pytest.mark.parametrize("value", PLANTED[:3], ids=repr)
def test_every_lease_operation_works_on_a_row_with_withheld_metadata(value: object) -> None:
    gateway, store, _ = _coordinator()
    row = _planted(store, value).row
    assert row is not None
    lease = LeaseHandle.of(row)
    renewed = gateway.heartbeat(lease, ttl=10)
    assert renewed.ok and renewed.lease is not None
    assert gateway.heartbeat_many([renewed.lease], ttl=10)[0].ok
    grant = gateway.issue_grant(renewed.lease, scopes=["tool:run"], ttl=5)
    assert grant.grant is not None
    assert gateway.validate(grant.grant, identity=IDENT, scopes=["tool:run"]).ok
    assert gateway.release(renewed.lease).ok
    view = gateway.current_holder(IDENT)
    assert view is not None and view.metadata_invalid and view.state is LeaseState.RELEASED
    # The next takeover replaces it: the row reads clean from then on.
    assert gateway.takeover(IDENT, "c2", scopes=[], ttl=10, expected_epoch=1, observed=view,
                            metadata=ROUTE).ok
    view = gateway.current_holder(IDENT)
    assert view is not None and not view.metadata_invalid and view.metadata == ROUTE
    assert not store.leases()[0].metadata_invalid


def test_withheld_metadata_is_logged_once_per_lease(caplog: pytest.LogCaptureFixture) -> None:
    gateway, store, _ = _coordinator()
    ident = LeaseIdentity("acme", "agent-1", f"warned-{uuid4().hex[:8]}")
    with caplog.at_level(logging.WARNING, "mos_lease.metadata"):
        _planted(store, {"k\x1b[31m": "v"}, ident)
        for _ in range(3):
            gateway.current_holder(ident)
        store.leases()
    warnings = [r for r in caplog.records if r.name == "mos_lease.metadata"]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    message = warnings[0].getMessage()
    assert repr(ident.binding_id) in message and "epoch 1" in message
    assert "\x1b" not in message and "\\x1b" in message  # escaped, never raw


def test_stored_metadata_judges_by_the_write_rule() -> None:
    assert stored_metadata(None, IDENT, 1) is EMPTY_METADATA
    assert stored_metadata({}, IDENT, 1) is EMPTY_METADATA
    for good in GOOD:
        shown = stored_metadata(dict(good), IDENT, 1)
        assert shown == check_metadata("metadata", good) and isinstance(shown, Metadata)
        assert stored_metadata(dict(good), IDENT, 1) == shown  # a second read: the same
    for value, _, _ in BAD:
        assert stored_metadata(value, IDENT, 1) is None, value
    for value in PLANTED:
        assert stored_metadata(value, IDENT, 1) is None, value
    # A payload once found good does not make an equal-looking bad one pass.
    assert stored_metadata({"k": "1"}, IDENT, 1) == {"k": "1"}
    assert stored_metadata({"k": 1}, IDENT, 1) is None
