"""The counters of ``stats()`` published as OpenTelemetry observable instruments
(``mos_lease.otel.OpenTelemetryStats``), read back through the SDK's in-memory reader."""

from __future__ import annotations

import gc
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from mos_lease import AllowAllPolicy, ConfigurationError, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.clock import ManualClock
from mos_lease.otel import OpenTelemetryStats
from mos_lease.supervisor import Supervisor
from mos_lease_memory import InMemoryLeaseStore

SCOPES = ("tool:run",)


def _points(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
    data = reader.get_metrics_data()
    out = {}
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for p in metric.data.data_points:
                        out[tuple(sorted((p.attributes or {}).items()))] = p.value
    return out


def _rig() -> tuple[InMemoryMetricReader, OpenTelemetryStats]:
    reader = InMemoryMetricReader()
    return reader, OpenTelemetryStats(MeterProvider(metric_readers=[reader]))


def test_store_and_coordinator_counts_appear_as_observable_counters() -> None:
    reader, published = _rig()
    store = InMemoryLeaseStore(ManualClock(datetime(2030, 1, 1, tzinfo=UTC)))
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    published.watch(store, name="main")
    published.watch(gateway, name="main")
    identity = LeaseIdentity("t", "a", "b")
    lease = gateway.acquire(identity, "c", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=20).grant
    assert grant is not None
    for _ in range(4):
        assert gateway.validate(grant, identity=identity, scopes=SCOPES).ok
    assert not gateway.validate(grant, identity=identity, scopes=["tool:write"]).ok
    trips = _points(reader, "mos_lease.store.round_trips")
    store_attributes = (("db.system.name", "memory"), ("mos_lease.source", "main"))
    assert trips == {tuple(sorted((*store_attributes, ("db.operation.name", name)))): n
                     for name, n in store.stats().round_trips.items()}
    # The grant issue's read and the five validations'.
    assert trips[tuple(sorted((*store_attributes, ("db.operation.name", "load"))))] \
        == store.stats().round_trips["load"] == 6
    operations = _points(reader, "mos_lease.coordinator.operations")
    key = (("mos_lease.operation", "validate"), ("mos_lease.outcome", "ok"),
           ("mos_lease.source", "main"))
    assert operations[key] == 4
    denials = _points(reader, "mos_lease.coordinator.denials")
    assert denials == {(("mos_lease.reason", "scope_not_authorized"),
                        ("mos_lease.source", "main")): 1}
    # Cumulative: a later collection sees the calls made since.
    assert gateway.validate(grant, identity=identity, scopes=SCOPES).ok
    assert _points(reader, "mos_lease.coordinator.operations")[key] == 5


def test_a_supervisors_counts_and_gauges_appear() -> None:
    reader, published = _rig()
    store = InMemoryLeaseStore()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    supervisor = Supervisor(gateway, background=False, sleep=lambda _s: None)
    published.watch(supervisor, name="sup")
    for i in range(3):
        supervisor.add(LeaseIdentity("t", f"a{i}", "b"), "c", scopes=SCOPES, ttl=30)
    supervisor.turn()
    stats = supervisor.stats()
    assert stats.bindings_held == 3
    bindings = _points(reader, "mos_lease.supervisor.bindings")
    assert bindings == {(("mos_lease.binding.state", "held"), ("mos_lease.source", "sup")): 3,
                        (("mos_lease.binding.state", "registered"),
                         ("mos_lease.source", "sup")): 3}
    calls = _points(reader, "mos_lease.supervisor.calls")
    assert calls[(("mos_lease.call", "acquire"), ("mos_lease.source", "sup"))] \
        == stats.acquires == 3
    assert _points(reader, "mos_lease.supervisor.renewal.ticks") == {
        (("mos_lease.source", "sup"),): stats.renewal_ticks}
    supervisor.close()


def test_watching_holds_nothing_alive_and_refuses_what_has_no_stats() -> None:
    reader, published = _rig()
    with pytest.raises(ConfigurationError, match="no stats"):
        published.watch(object())
    with pytest.raises(ConfigurationError, match="name"):
        published.watch(InMemoryLeaseStore(), name="")
    store = InMemoryLeaseStore()
    published.watch(store, name="gone")
    store.load_many([])
    assert _points(reader, "mos_lease.store.reconciles") == {
        (("db.system.name", "memory"), ("mos_lease.source", "gone")): 0}
    del store
    gc.collect()
    assert _points(reader, "mos_lease.store.reconciles") == {}
