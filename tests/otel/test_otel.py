"""The OpenTelemetry hook, read back through the SDK's in-memory reader and exporter."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, Reason
from mos_lease.otel import OpenTelemetryHook
from mos_lease_pg import PostgresLeaseStore
from tests.core.test_keeper import make_rig
from tests.helpers import IDENT, OTHER_IDENT, SCOPES, CountingIds, FaultyStore, make_env


@attrs.define
class Otel:
    hook: OpenTelemetryHook
    reader: InMemoryMetricReader
    spans: InMemorySpanExporter

    def finished(self) -> tuple[ReadableSpan, ...]:
        return self.spans.get_finished_spans()

    def points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        """(attributes, data point) of every point of metric ``name``."""
        data = self.reader.get_metrics_data()
        out = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        out += [(dict(p.attributes or {}), p) for p in metric.data.data_points]
        return out

    def counts(self, **match: str) -> dict[tuple[Any, ...], int]:
        keys = sorted(match)
        return {tuple(attributes.get(k) for k in ("mos_lease.operation", "mos_lease.outcome",
                                                  "mos_lease.reason")): p.value
                for attributes, p in self.points("mos_lease.events")
                if all(attributes.get(k) == match[k] for k in keys)}


@pytest.fixture
def otel() -> Iterator[Otel]:
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    yield Otel(OpenTelemetryHook(meter_provider=meters, tracer_provider=tracers), reader,
               exporter)
    meters.shutdown()
    tracers.shutdown()


def test_operations_are_counted_by_operation_outcome_and_reason(otel: Otel) -> None:
    env = make_env()
    c = ConnectorLeaseCoordinator(env.store, AllowAllPolicy(), id_source=CountingIds(),
                                  on_event=otel.hook)
    lease = c.acquire(IDENT, "a", scopes=SCOPES, ttl=10).lease
    assert lease is not None
    for _ in range(3):
        assert c.acquire(IDENT, "b", scopes=SCOPES, ttl=10).reason is Reason.LEASE_HELD
    grant = c.issue_grant(lease, scopes=["tool:run"], ttl=5).grant
    assert grant is not None
    for _ in range(2):
        assert c.validate(grant, identity=IDENT, scopes=["tool:run"]).ok
    assert otel.counts(**{"mos_lease.event": "operation"}) == {
        ("acquire", "acquired", None): 1,
        ("acquire", "denied", "lease_held"): 3,
        ("grant_issue", "grant_issued", None): 1,
        ("grant_validate", "validated", None): 2,
    }
    durations = {(a["mos_lease.operation"], a["mos_lease.outcome"]): p.count
                 for a, p in otel.points("mos_lease.operation.duration")}
    assert durations[("acquire", "denied")] == 3
    assert durations[("grant_validate", "validated")] == 2
    db = {a["db.operation.name"]: p.count for a, p in otel.points(
        "db.client.operation.duration")}
    # acquire: apply (+ record when refused, named from the row the write found);
    # issue: load + record; validate: load.
    assert db == {"apply": 4, "load": 1 + 2, "record": 3 + 1}


def test_store_calls_are_client_spans_with_database_conventions(otel: Otel) -> None:
    env = make_env()
    faulty = FaultyStore(env.store)
    faulty.db_system = "memory"  # type: ignore[attr-defined]
    c = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=CountingIds(),
                                  on_event=otel.hook)
    lease = c.acquire(IDENT, "a", scopes=SCOPES, ttl=10).lease
    assert lease is not None
    second = c.acquire(OTHER_IDENT, "a", scopes=SCOPES, ttl=10).lease
    assert second is not None
    assert len(c.heartbeat_many([lease, second], ttl=10)) == 2
    faulty.fail_load = True
    with pytest.raises(Exception, match="connection refused"):
        c.current_holder(IDENT)
    spans = otel.finished()
    assert [s.name for s in spans] == ["apply", "apply", "renew_many", "load"]
    for span in spans:
        assert span.kind is SpanKind.CLIENT
        assert span.attributes is not None
        assert span.attributes["db.system.name"] == "memory"
        assert span.attributes["db.system"] == "memory"
        assert span.attributes["db.operation.name"] == span.name
        assert span.start_time is not None and span.end_time is not None
        assert span.start_time <= span.end_time
    assert spans[2].attributes is not None
    assert spans[2].attributes["db.operation.batch.size"] == 2
    failed = spans[-1]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == "StoreUnavailable"
    assert all("error.type" not in (s.attributes or {}) for s in spans[:-1])
    errors = [a for a, _ in otel.points("db.client.operation.duration")
              if "error.type" in a]
    assert errors == [{"db.system.name": "memory", "db.system": "memory",
                       "db.operation.name": "load", "error.type": "StoreUnavailable"}]


def test_spans_carry_the_call_s_own_start_and_end(otel: Otel) -> None:
    """The hook runs after the call; the span must still cover the call, not the moment
    the hook ran."""
    from mos_lease.events import StoreCall

    otel.hook(StoreCall("load", "postgresql", 1_700_000_000_250_000_000, 0.5, None))
    (span,) = otel.finished()
    assert span.start_time == 1_700_000_000_250_000_000
    assert span.end_time == 1_700_000_000_750_000_000
    assert span.attributes is not None and span.attributes["db.system.name"] == "postgresql"


def test_keeper_events_are_counted(otel: Otel) -> None:
    rig = make_rig()
    keeper = rig.keeper(on_event=otel.hook)
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    keeper.step()
    keeper.step()
    rig.faulty.mode = "down"
    while not keeper.lost.is_set():
        keeper.step()
    points = otel.points("mos_lease.events")
    by_kind: dict[str, int] = {}
    for attributes, p in points:
        by_kind[attributes["mos_lease.event"]] = by_kind.get(attributes["mos_lease.event"],
                                                             0) + p.value
    assert by_kind["renewed"] == 1 and by_kind["lost"] == 1 and by_kind["renewal_retry"] >= 5
    (lost,) = [a for a, _ in points if a["mos_lease.event"] == "lost"]
    assert lost == {"mos_lease.event": "lost", "mos_lease.loss.cause": "deadline",
                    "mos_lease.reason": "lease_expired"}
    (retry,) = [a for a, _ in points if a["mos_lease.event"] == "renewal_retry"]
    assert retry["error.type"] == "StoreUnavailable"
    (renewal,) = otel.points("mos_lease.keeper.renewal.duration")
    assert renewal[1].count == 1


@pytest.mark.pg
def test_a_postgres_store_is_named_postgresql(otel: Otel,
                                              pg_store: PostgresLeaseStore) -> None:
    c = ConnectorLeaseCoordinator(pg_store, AllowAllPolicy(), on_event=otel.hook)
    c.current_holder(IDENT)  # a read: one store call, one span
    (span,) = otel.finished()
    assert span.attributes is not None
    assert (span.name, span.attributes["db.system.name"]) == ("load", "postgresql")


def test_importing_mos_lease_does_not_import_opentelemetry() -> None:
    code = ("import sys, mos_lease, mos_lease_memory\n"
            "bad = sorted(m for m in sys.modules if m.startswith('opentelemetry')"
            " or m == 'mos_lease.otel')\n"
            "print(bad)\n"
            "import mos_lease.otel\n"
            "print('opentelemetry' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.split() == ["[]", "True"]
