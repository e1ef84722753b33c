"""OpenTelemetry metrics and traces for mos-lease, as an ``on_event`` hook.

Needs the ``otel`` extra (``pip install 'mos-lease[otel]'``, which brings only
``opentelemetry-api``; the application chooses and configures the SDK and exporters).
``import mos_lease`` never imports this module, so the library itself never depends on
OpenTelemetry::

    from mos_lease.otel import OpenTelemetryHook

    hook = OpenTelemetryHook()  # the global meter and tracer providers
    coordinator = ConnectorLeaseCoordinator(store, policy, on_event=hook)
    keeper = LeaseKeeper(coordinator, ttl=30, on_event=hook)

:class:`OpenTelemetryStats` publishes the always-on counters of ``stats()``
(:mod:`mos_lease.stats`) as observable instruments, read only when the SDK collects.

What the hook records (names in ``docs/telemetry.md``): one counter of every event by kind,
operation, outcome and reason; operation, store-call and renewal duration histograms; and a
``CLIENT`` span per store call following the OpenTelemetry database semantic conventions.
Attribute values are enum values, operation names and exception type names only: identity
ids stay out of metrics (unbounded cardinality), and scopes, grants, tokens and lease UUIDs
are not in the events this hook receives at all.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Final

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
from opentelemetry.trace import SpanKind, StatusCode, TracerProvider
from opentelemetry.util.types import AttributeValue

from mos_lease.errors import ConfigurationError
from mos_lease.events import (
    Event,
    Lost,
    OperationFinished,
    RenewalRetry,
    Renewed,
    StoreCall,
    store_system,
)
from mos_lease.fleet.membership import FleetStatus
from mos_lease.stats import CoordinatorStats, StoreStats, SupervisorStats

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


# -- the counters of stats(), as observable instruments -----------------------------------

SOURCE: Final = "mos_lease.source"
QUEUE: Final = "mos_lease.queue"
CALL: Final = "mos_lease.call"
STATE: Final = "mos_lease.binding.state"
FLEET: Final = "mos_lease.fleet.name"
MEMBER: Final = "mos_lease.fleet.member"
FLEET_STATE: Final = "mos_lease.fleet.binding.state"
DIRECTION: Final = "mos_lease.fleet.direction"

_Watched = tuple[Callable[[], Any], dict[str, AttributeValue]]


class OpenTelemetryStats:
    """The counters of ``stats()`` (:mod:`mos_lease.stats`) of stores, coordinators and
    supervisors, published as OpenTelemetry observable instruments.

    Nothing is added to any call path: the instruments' callbacks read each watched
    object's ``stats()`` when the SDK collects (its metric reader's interval). Pass each
    object to :meth:`watch` with a ``name`` (the ``mos_lease.source`` attribute) that tells
    several apart; a watched object is held weakly and dropped once it is gone. A supervisor
    that is a fleet member (``fleet=``) has its ``fleet_status()`` published too, as the
    ``mos_lease.fleet.*`` gauges and counters, with the fleet's and the member's names as
    attributes. Names and attributes are in ``docs/telemetry.md``."""

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        meter = metrics.get_meter(INSTRUMENTATION_NAME, meter_provider=meter_provider)
        self._stores: list[_Watched] = []
        self._coordinators: list[_Watched] = []
        self._supervisors: list[_Watched] = []
        self._fleets: list[_Watched] = []  # supervisors' fleet_status(), if in a fleet
        self._lock = threading.Lock()
        counter, gauge = meter.create_observable_counter, meter.create_observable_gauge
        counter("mos_lease.store.round_trips", [self._round_trips], unit="{statement}",
                description="Statements a mos-lease store sent, by statement")
        counter("mos_lease.store.coalesced.batches", [self._batches], unit="{statement}",
                description="Coalesced statements sent for the calls queued behind one in "
                "flight, by queue (load, record)")
        counter("mos_lease.store.coalesced.calls", [self._batched], unit="{call}",
                description="Calls carried by coalesced statements, by queue")
        counter("mos_lease.store.commit_outcome_unknown", [self._in_doubt], unit="{statement}",
                description="Statements whose commit outcome was lost")
        counter("mos_lease.store.reconciles", [self._reconciles], unit="{call}",
                description="Writes in doubt settled (event_committed calls)")
        counter("mos_lease.coordinator.operations", [self._operations], unit="{operation}",
                description="Coordinator operations, by operation and outcome")
        counter("mos_lease.coordinator.denials", [self._denials], unit="{operation}",
                description="Coordinator refusals, by reason")
        counter("mos_lease.coordinator.failures", [self._failures], unit="{operation}",
                description="Coordinator calls that raised, by operation")
        counter("mos_lease.supervisor.renewal.ticks", [self._ticks], unit="{batch}",
                description="Renewal batches a supervisor sent")
        counter("mos_lease.supervisor.renewal.leases", [self._renewed], unit="{lease}",
                description="Leases carried by a supervisor's renewal batches")
        counter("mos_lease.supervisor.renewal.hedges", [self._hedges], unit="{batch}",
                description="Renewal batches sent again on the other renewal connection")
        counter("mos_lease.supervisor.calls", [self._campaign], unit="{call}",
                description="A supervisor's campaign calls and releases, by call")
        counter("mos_lease.keep.notices", [self._notices], unit="{notice}",
                description="Lease notices worth a confirming read")
        gauge("mos_lease.supervisor.renewal.last_leases", [self._last_renewed], unit="{lease}",
              description="Leases in a supervisor's latest renewal batch")
        gauge("mos_lease.supervisor.bindings", [self._bindings], unit="{binding}",
              description="A supervisor's bindings now, registered and held")
        # A fleet member's view of its fleet (Supervisor.fleet_status()), read the same way.
        gauge("mos_lease.fleet.bindings", [self._fleet_bindings], unit="{binding}",
              description="A fleet member's bindings now: held, preferred to it, preferred "
              "and not held, and seen without any holder")
        gauge("mos_lease.fleet.unheld.oldest_age", [self._fleet_unheld_age], unit="s",
              description="How long the oldest binding a fleet member saw without a holder "
              "has been so (0 if none)")
        gauge("mos_lease.fleet.members", [self._fleet_members], unit="{member}",
              description="Live members of the fleet, as a member last read them")
        counter("mos_lease.fleet.hand_offs", [self._fleet_hand_offs], unit="{binding}",
                description="Bindings a fleet member handed to another (out) or took over "
                "after their holder released them (in)")
        counter("mos_lease.fleet.takeovers", [self._fleet_takeovers], unit="{binding}",
                description="Bindings a fleet member took over from an expired lease")

    def watch(self, source: object, *, name: str = "default") -> None:
        """Publish the counts of ``source``: a lease store, a coordinator or a supervisor
        (anything whose ``stats()`` returns one of the :mod:`mos_lease.stats` snapshots)."""
        stats: Any = getattr(source, "stats", None)
        if not isinstance(name, str) or not name:
            raise ConfigurationError("name must be a non-empty string")
        snapshot = stats() if callable(stats) else None
        attributes: dict[str, AttributeValue]
        if isinstance(snapshot, StoreStats):
            kind, attributes = self._stores, {SOURCE: name,
                                              DB_SYSTEM_NAME: store_system(source)}
        elif isinstance(snapshot, CoordinatorStats):
            kind, attributes = self._coordinators, {SOURCE: name}
        elif isinstance(snapshot, SupervisorStats):
            kind, attributes = self._supervisors, {SOURCE: name}
        else:
            raise ConfigurationError(f"cannot watch {type(source).__name__}: it has no stats() "
                                     "of a store, a coordinator or a supervisor")
        ref: Callable[[], Any] = weakref.WeakMethod(stats)
        fleet: Any = getattr(source, "fleet_status", None) if kind is self._supervisors \
            else None
        status = fleet() if callable(fleet) else None
        with self._lock:
            kind.append((ref, attributes))
            if isinstance(status, FleetStatus):  # a member of a fleet: its gauges too
                self._fleets.append((weakref.WeakMethod(fleet), {
                    **attributes, FLEET: status.fleet, MEMBER: status.member}))

    def _read(self, kind: list[_Watched]) -> list[tuple[Any, dict[str, AttributeValue]]]:
        with self._lock:
            alive = [(ref(), attributes) for ref, attributes in kind]
            # Objects gone since the last collection are dropped here.
            kind[:] = [w for w, (stats, _a) in zip(kind, alive, strict=True)
                       if stats is not None]
        return [(stats(), attributes) for stats, attributes in alive if stats is not None]

    def _round_trips(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._stores):
            for statement, n in stats.round_trips.items():
                yield Observation(n, {**attributes, DB_OPERATION_NAME: statement})

    def _batches(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._stores):
            yield Observation(stats.load_batches, {**attributes, QUEUE: "load"})
            yield Observation(stats.record_batches, {**attributes, QUEUE: "record"})

    def _batched(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._stores):
            yield Observation(stats.loads_batched, {**attributes, QUEUE: "load"})
            yield Observation(stats.records_batched, {**attributes, QUEUE: "record"})

    def _in_doubt(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._stores):
            yield Observation(stats.commit_outcome_unknown, attributes)

    def _reconciles(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._stores):
            yield Observation(stats.reconciles, attributes)

    def _operations(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._coordinators):
            for operation, outcomes in stats.operations.items():
                for outcome, n in outcomes.items():
                    yield Observation(n, {**attributes, OPERATION: operation,
                                          OUTCOME: outcome})

    def _denials(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._coordinators):
            for reason, n in stats.denials.items():
                yield Observation(n, {**attributes, REASON: reason})

    def _failures(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._coordinators):
            for operation, n in stats.failed.items():
                yield Observation(n, {**attributes, OPERATION: operation})

    def _supervisor(self, field: str) -> Iterable[Observation]:
        for stats, attributes in self._read(self._supervisors):
            yield Observation(getattr(stats, field), attributes)

    def _ticks(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._supervisor("renewal_ticks")

    def _renewed(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._supervisor("leases_renewed")

    def _hedges(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._supervisor("renewal_hedges")

    def _last_renewed(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._supervisor("last_renewed")

    def _notices(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._supervisor("notices")

    def _campaign(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._supervisors):
            for call, n in (("read", stats.campaign_reads), ("acquire", stats.acquires),
                            ("takeover", stats.takeovers), ("release", stats.releases)):
                yield Observation(n, {**attributes, CALL: call})

    def _bindings(self, _options: CallbackOptions) -> Iterable[Observation]:
        for stats, attributes in self._read(self._supervisors):
            yield Observation(stats.bindings, {**attributes, STATE: "registered"})
            yield Observation(stats.bindings_held, {**attributes, STATE: "held"})

    def _fleet_statuses(self) -> Iterable[tuple[FleetStatus, dict[str, AttributeValue]]]:
        for status, attributes in self._read(self._fleets):
            if isinstance(status, FleetStatus):
                yield status, attributes

    def _fleet_bindings(self, _options: CallbackOptions) -> Iterable[Observation]:
        for status, attributes in self._fleet_statuses():
            for state, n in (("held", status.held), ("preferred", status.preferred),
                             ("preferred_not_held", status.preferred_not_held),
                             ("unheld", status.unheld)):
                yield Observation(n, {**attributes, FLEET_STATE: state})

    def _fleet_unheld_age(self, _options: CallbackOptions) -> Iterable[Observation]:
        for status, attributes in self._fleet_statuses():
            yield Observation(status.unheld_for, attributes)

    def _fleet_members(self, _options: CallbackOptions) -> Iterable[Observation]:
        for status, attributes in self._fleet_statuses():
            yield Observation(0 if status.view is None else len(status.view.members),
                              attributes)

    def _fleet_hand_offs(self, _options: CallbackOptions) -> Iterable[Observation]:
        for status, attributes in self._fleet_statuses():
            yield Observation(status.hand_offs, {**attributes, DIRECTION: "out"})
            yield Observation(status.hand_offs_in, {**attributes, DIRECTION: "in"})

    def _fleet_takeovers(self, _options: CallbackOptions) -> Iterable[Observation]:
        for status, attributes in self._fleet_statuses():
            yield Observation(status.takeovers, attributes)
