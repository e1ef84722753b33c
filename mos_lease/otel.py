"""OpenTelemetry metrics and traces for mos-lease, as an ``on_event`` hook.

Needs the ``otel`` extra (``pip install 'mos-lease[otel]'``, which brings only
``opentelemetry-api``; the application chooses and configures the SDK and exporters).
``import mos_lease`` never imports this module, so the library itself never depends on
OpenTelemetry::

    from mos_lease.otel import OpenTelemetryHook

    hook = OpenTelemetryHook()  # the global meter and tracer providers
    coordinator = ConnectorLeaseCoordinator(store, policy, on_event=hook)
    keeper = LeaseKeeper(coordinator, ttl=30, on_event=hook)

What is recorded (names in ``docs/telemetry.md``): one counter of every event by kind,
operation, outcome and reason; operation, store-call and renewal duration histograms; and a
``CLIENT`` span per store call following the OpenTelemetry database semantic conventions.
Attribute values are enum values, operation names and exception type names only: identity
ids stay out of metrics (unbounded cardinality), and scopes, grants, tokens and lease UUIDs
are not in the events this hook receives at all.
"""

from __future__ import annotations

from typing import Final

from opentelemetry import metrics, trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import SpanKind, StatusCode, TracerProvider
from opentelemetry.util.types import AttributeValue

from mos_lease.events import (
    Event,
    Lost,
    OperationFinished,
    RenewalRetry,
    Renewed,
    StoreCall,
)

INSTRUMENTATION_NAME: Final = "mos_lease"

# Attribute names. The ``db.*`` and ``error.type`` ones are the stable OpenTelemetry database
# semantic conventions; ``db.system`` repeats ``db.system.name`` under its pre-stable name,
# which back ends built on the older conventions still group by.
DB_SYSTEM_NAME: Final = "db.system.name"
DB_SYSTEM_LEGACY: Final = "db.system"
DB_OPERATION_NAME: Final = "db.operation.name"
DB_BATCH_SIZE: Final = "db.operation.batch.size"
ERROR_TYPE: Final = "error.type"
EVENT: Final = "mos_lease.event"
OPERATION: Final = "mos_lease.operation"
OUTCOME: Final = "mos_lease.outcome"
REASON: Final = "mos_lease.reason"
LOSS_CAUSE: Final = "mos_lease.loss.cause"

# ``db.client.operation.duration`` buckets recommended by the conventions (seconds).
_DB_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)


class OpenTelemetryHook:
    """An ``on_event`` hook recording mos-lease events as OpenTelemetry metrics and spans.

    ``meter_provider`` and ``tracer_provider`` default to the global providers (which do
    nothing until the application installs an SDK). One hook may serve any number of
    coordinators and keepers, from any thread.
    """

    def __init__(self, meter_provider: MeterProvider | None = None,
                 tracer_provider: TracerProvider | None = None) -> None:
        meter = metrics.get_meter(INSTRUMENTATION_NAME, meter_provider=meter_provider)
        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
        self._events = meter.create_counter(
            "mos_lease.events", unit="{event}",
            description="mos-lease telemetry events, by kind, operation, outcome and reason")
        self._operation_duration = meter.create_histogram(
            "mos_lease.operation.duration", unit="s",
            description="Duration of mos-lease operations, store calls included")
        self._db_duration = meter.create_histogram(
            "db.client.operation.duration", unit="s",
            description="Duration of mos-lease store calls",
            explicit_bucket_boundaries_advisory=list(_DB_BUCKETS))
        self._renewal_duration = meter.create_histogram(
            "mos_lease.keeper.renewal.duration", unit="s",
            description="Duration of successful keeper heartbeats")

    def __call__(self, event: Event) -> None:
        if isinstance(event, StoreCall):
            self._store_call(event)
            return
        attributes: dict[str, AttributeValue]
        if isinstance(event, OperationFinished):
            attributes = {EVENT: "operation", OPERATION: str(event.operation),
                          OUTCOME: str(event.outcome)}
            if event.reason is not None:
                attributes[REASON] = str(event.reason)
            self._operation_duration.record(event.duration, attributes)
        elif isinstance(event, Renewed):
            attributes = {EVENT: "renewed"}
            self._renewal_duration.record(event.duration)
        elif isinstance(event, RenewalRetry):
            attributes = {EVENT: "renewal_retry", ERROR_TYPE: event.cause}
        elif isinstance(event, Lost):
            attributes = {EVENT: "lost", LOSS_CAUSE: event.cause, REASON: str(event.reason)}
        else:
            return  # a kind added later: ignored rather than guessed at
        self._events.add(1, attributes)

    def _store_call(self, call: StoreCall) -> None:
        attributes: dict[str, AttributeValue] = {
            DB_SYSTEM_NAME: call.system, DB_SYSTEM_LEGACY: call.system,
            DB_OPERATION_NAME: call.operation}
        if call.batch_size > 1:
            attributes[DB_BATCH_SIZE] = call.batch_size
        if call.error is not None:
            attributes[ERROR_TYPE] = call.error
        self._db_duration.record(call.duration, attributes)
        self._events.add(1, {EVENT: "store_call", **attributes})
        # The event arrives after the call, so the span is made with the call's own start
        # and end instead of the time the hook happens to run.
        start = call.started_ns
        span = self._tracer.start_span(call.operation, kind=SpanKind.CLIENT,
                                       attributes=attributes, start_time=start)
        if call.error is not None:
            span.set_status(StatusCode.ERROR, call.error)
        span.end(end_time=start + int(call.duration * 1e9))
