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
from mos_lease.stats import StoreStats, SupervisorStats
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
                        point: Any = p  # a sum or a gauge: each has a value
                        out[tuple(sorted((point.attributes or {}).items()))] = point.value
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
    supervisor.turn()  # a new binding reads its holder first (one batched read of three)
    supervisor.turn()  # then the three with no row are acquired together
    stats = supervisor.stats()
    assert stats.bindings_held == 3 and stats.campaign_reads == 3
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


class _Fixed:
    """A source whose ``stats()`` is a given snapshot, each count a different number, so a
    count published under another's name shows."""

    db_system = "postgresql"

    def __init__(self, snapshot: object) -> None:
        self.snapshot = snapshot

    def stats(self) -> object:
        return self.snapshot


def test_each_count_is_published_under_its_own_name() -> None:
    reader, published = _rig()
    store = _Fixed(StoreStats({"load": 2, "load_many": 3}, load_batches=5, loads_batched=7,
                              record_batches=11, records_batched=13,
                              commit_outcome_unknown=17, reconciles=19))
    supervisor = _Fixed(SupervisorStats(renewal_ticks=2, leases_renewed=3, last_renewed=5,
                                        campaign_reads=7, acquires=11, takeovers=13,
                                        releases=17, notices=19, bindings=23,
                                        bindings_held=29, renewal_hedges=31))
    published.watch(store, name="s")
    published.watch(supervisor, name="v")

    def values(name: str) -> dict[str, Any]:
        return {",".join(f"{v}" for k, v in key if k not in ("mos_lease.source",
                                                                "db.system.name")): n
                for key, n in _points(reader, name).items()}

    assert values("mos_lease.store.round_trips") == {"load": 2, "load_many": 3}
    assert values("mos_lease.store.coalesced.batches") == {"load": 5, "record": 11}
    assert values("mos_lease.store.coalesced.calls") == {"load": 7, "record": 13}
    assert values("mos_lease.store.commit_outcome_unknown") == {"": 17}
    assert values("mos_lease.store.reconciles") == {"": 19}
    assert values("mos_lease.supervisor.renewal.ticks") == {"": 2}
    assert values("mos_lease.supervisor.renewal.leases") == {"": 3}
    assert values("mos_lease.supervisor.renewal.hedges") == {"": 31}
    assert values("mos_lease.supervisor.renewal.last_leases") == {"": 5}
    assert values("mos_lease.supervisor.calls") == {"read": 7, "acquire": 11, "takeover": 13,
                                                    "release": 17}
    assert values("mos_lease.keep.notices") == {"": 19}
    assert values("mos_lease.supervisor.bindings") == {"registered": 23, "held": 29}


def test_a_fleet_members_view_is_published_as_gauges() -> None:
    """Two members of fleet ``edge`` on a manual clock, one watched: the gauges and
    counters read through the SDK are its ``fleet_status()``, attributed to the fleet and
    the member, and move with it (a hand-off out after a join)."""
    from mos_lease.fleet import Fleet
    from tests.helpers import Time

    reader, published = _rig()
    time = Time()
    store = InMemoryLeaseStore(time.wall)
    bindings = [LeaseIdentity("t", f"a{i}", "b") for i in range(40)]

    def member(name: str) -> Supervisor:
        supervisor = Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()),
                                clock=time, background=False, sleep=lambda _s: None,
                                fleet=Fleet("edge", name, members=["m1", "m2"], ttl=30,
                                            grace=3, look=1))
        for identity in bindings:
            supervisor.add(identity, name, scopes=SCOPES, ttl=30)
        return supervisor

    def turns(members: list[Supervisor], seconds: float) -> None:
        for _ in range(round(seconds / 0.25)):
            for supervisor in members:
                for _ in range(3):
                    supervisor.turn()
            time.advance(0.25)

    m1 = member("m1")
    published.watch(m1, name="gw")
    turns([m1], 2)
    me = (("mos_lease.fleet.member", "m1"), ("mos_lease.fleet.name", "edge"),
          ("mos_lease.source", "gw"))

    def by(name: str, key: str | None = None) -> dict[Any, Any]:
        return {dict(k).get(key) if key else None: v for k, v in _points(reader, name).items()
                if set(me) <= set(k)}

    assert by("mos_lease.fleet.bindings", "mos_lease.fleet.binding.state") == {
        "held": 40, "preferred": 40, "preferred_not_held": 0, "unheld": 0}
    assert by("mos_lease.fleet.members") == {None: 1}
    assert by("mos_lease.fleet.unheld.oldest_age") == {None: 0.0}
    assert by("mos_lease.fleet.hand_offs", "mos_lease.fleet.direction") == {"out": 0, "in": 0}
    m2 = member("m2")
    turns([m1, m2], 4)
    status = m1.fleet_status()
    assert status is not None and 0 < status.hand_offs < 40
    gauges = by("mos_lease.fleet.bindings", "mos_lease.fleet.binding.state")
    assert gauges == {"held": status.held, "preferred": status.preferred,
                      "preferred_not_held": status.preferred_not_held,
                      "unheld": status.unheld}
    assert gauges["held"] == 40 - status.hand_offs
    assert by("mos_lease.fleet.members") == {None: 2}
    assert by("mos_lease.fleet.hand_offs", "mos_lease.fleet.direction") == {
        "out": status.hand_offs, "in": 0}
    assert by("mos_lease.fleet.takeovers") == {None: 0}
    # Each instrument is of the kind the docs name: gauges for what is now, counters
    # (cumulative sums) for what happened.
    data = reader.get_metrics_data()
    assert data is not None
    kinds = {m.name: type(m.data).__name__ for rm in data.resource_metrics
             for sm in rm.scope_metrics for m in sm.metrics if m.name.startswith("mos_lease.fleet")}
    assert kinds == {"mos_lease.fleet.bindings": "Gauge", "mos_lease.fleet.members": "Gauge",
                     "mos_lease.fleet.unheld.oldest_age": "Gauge",
                     "mos_lease.fleet.hand_offs": "Sum", "mos_lease.fleet.takeovers": "Sum"}
    m1.close()
    m2.close()


def test_a_supervisor_outside_a_fleet_publishes_no_fleet_gauge() -> None:
    reader, published = _rig()
    supervisor = Supervisor(ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy()),
                            background=False, sleep=lambda _s: None)
    published.watch(supervisor, name="solo")
    supervisor.add(LeaseIdentity("t", "a", "b"), "c", scopes=SCOPES, ttl=30)
    supervisor.turn()
    assert _points(reader, "mos_lease.supervisor.bindings")
    for name in ("mos_lease.fleet.bindings", "mos_lease.fleet.members",
                 "mos_lease.fleet.unheld.oldest_age", "mos_lease.fleet.hand_offs",
                 "mos_lease.fleet.takeovers"):
        assert _points(reader, name) == {}, name
    supervisor.close()


class _FixedMember(_Fixed):
    def __init__(self, snapshot: object, status: object) -> None:
        super().__init__(snapshot)
        self.status = status

    def fleet_status(self) -> object:
        return self.status


def test_each_fleet_figure_is_published_under_its_own_name() -> None:
    from mos_lease.fleet.membership import FleetStatus

    reader, published = _rig()
    status = FleetStatus(None, held=2, preferred=3, preferred_not_held=5, unheld=7,
                         unheld_since=datetime(2030, 1, 1, tzinfo=UTC), hand_offs=11,
                         unheld_for=13.5, hand_offs_in=17, takeovers=19, fleet="edge",
                         member="m9")
    source = _FixedMember(SupervisorStats(), status)  # watched weakly: kept here
    published.watch(source, name="v")

    def values(name: str) -> dict[str, Any]:
        out = {}
        for key, n in _points(reader, name).items():
            attributes = dict(key)
            assert (attributes.pop("mos_lease.fleet.name"), attributes.pop(
                "mos_lease.fleet.member"), attributes.pop("mos_lease.source")) == (
                "edge", "m9", "v")
            out[",".join(attributes.values())] = n
        return out

    assert values("mos_lease.fleet.bindings") == {"held": 2, "preferred": 3,
                                                  "preferred_not_held": 5, "unheld": 7}
    assert values("mos_lease.fleet.unheld.oldest_age") == {"": 13.5}
    assert values("mos_lease.fleet.members") == {"": 0}  # no member read yet
    assert values("mos_lease.fleet.hand_offs") == {"out": 11, "in": 17}
    assert values("mos_lease.fleet.takeovers") == {"": 19}
