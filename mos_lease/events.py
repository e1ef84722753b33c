"""Telemetry events: what the coordinators and keepers report to an ``on_event`` hook.

Every event is a frozen value built only from fields that are safe to export anywhere:
identity ids, connector ids, epochs, outcomes, reasons, durations, correlation ids and
exception type names. No event has a field for scopes, grants, tokens, lease UUIDs or audit
event ids, so no exporter can leak them, whatever it does with the fields it is given.

The hook is optional. Without one the coordinators pay a single ``is None`` check per
operation; with one, each store call is timed and one event per lifecycle attempt follows
the operation (see ``docs/telemetry.md``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import attrs

from mos_lease.errors import ConfigurationError
from mos_lease.records import AuditEntry, LeaseHandle
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason

log = logging.getLogger("mos_lease.events")


@attrs.frozen(slots=True)
class OperationFinished:
    """One lifecycle attempt (the same attempt the audit log records) or one validation.

    ``duration`` is the whole operation in seconds on the coordinator's monotonic clock,
    policy call and every store call included; a batched heartbeat reports one event per
    lease, each with the batch's duration. A successful validation, which writes no audit
    row, is reported too (outcome ``validated``).
    """

    operation: LifecycleEvent
    tenant_id: str
    logical_agent_id: str
    binding_id: str
    connector_id: str
    epoch: int | None
    outcome: Outcome
    reason: Reason | None
    duration: float
    correlation_id: str

    @classmethod
    def of(cls, entry: AuditEntry, duration: float) -> OperationFinished:
        """The event for the audit entry of an operation that took ``duration`` seconds."""
        identity = entry.identity
        return cls(entry.event, identity.tenant_id, identity.logical_agent_id,
                   identity.binding_id, entry.connector_id, entry.epoch, entry.outcome,
                   entry.reason, duration, entry.correlation_id)


@attrs.frozen(slots=True)
class StoreCall:
    """One call of a store port method (``load``, ``apply``, ``renew_many``, ``record``,
    ``event_committed``, the batch methods), successful or not.

    ``system`` is what the store is (:func:`store_system`); ``started_ns`` is the wall
    clock (Unix nanoseconds, ``time.time_ns()``) when the call began, for tracing back ends
    that place spans in time; ``duration`` is measured on the monotonic clock; ``error`` is
    the exception's type name, ``None`` if the call returned; ``batch_size`` is the number
    of writes of a ``renew_many``, ``acquire_many``, ``takeover_many`` or ``release_many``,
    or of identities of a ``load_many`` (else 1).
    """

    operation: str
    system: str
    started_ns: int
    duration: float
    error: str | None
    batch_size: int = 1


@attrs.frozen(slots=True)
class Renewed:
    """A keeper's heartbeat succeeded; ``duration`` is the heartbeat's round trip."""

    tenant_id: str
    logical_agent_id: str
    binding_id: str
    connector_id: str
    epoch: int
    duration: float


@attrs.frozen(slots=True)
class RenewalRetry:
    """A keeper's heartbeat failed transiently; it is tried again after ``delay`` seconds.

    ``cause`` is the exception's type name (``StoreUnavailable``, ``CommitOutcomeUnknown``);
    ``attempt`` counts the failures since the last success (1 for the first).
    """

    tenant_id: str
    logical_agent_id: str
    binding_id: str
    connector_id: str
    epoch: int
    cause: str
    attempt: int
    delay: float


@attrs.frozen(slots=True)
class Lost:
    """A keeper stopped holding its lease. ``cause`` is a :class:`~mos_lease.LossCause`
    value as a plain string (the keeper imports this module, not the other way round):
    ``denied``, ``deadline``, ``error``, or ``stopped`` for a deliberate stop; ``reason`` as
    in :class:`~mos_lease.LeaseLoss`."""

    tenant_id: str
    logical_agent_id: str
    binding_id: str
    connector_id: str
    epoch: int
    cause: str
    reason: Reason


Event = OperationFinished | StoreCall | Renewed | RenewalRetry | Lost
"""Every event an ``on_event`` hook receives."""
EventHook = Callable[[Event], object]
"""What ``on_event=`` takes: called synchronously, on the thread (or loop) that did the
work, so it should be quick; whatever it returns is ignored."""


def renewal(lease: LeaseHandle, duration: float, cause: str | None = None, attempt: int = 0,
            delay: float = 0.0) -> Renewed | RenewalRetry:
    """The event of one renewal of ``lease`` that kept it: :class:`Renewed` after
    ``duration`` seconds, or, given the ``cause`` of a transient failure, the
    :class:`RenewalRetry` of failure ``attempt`` tried again after ``delay`` seconds. Built
    here for a keeper and a supervisor alike."""
    who = (lease.identity.tenant_id, lease.identity.logical_agent_id,
           lease.identity.binding_id, lease.connector_id, lease.epoch)
    if cause is None:
        return Renewed(*who, duration)
    return RenewalRetry(*who, cause, attempt, delay)


def loss(lease: LeaseHandle, cause: str, reason: Reason) -> Lost:
    """The :class:`Lost` event of ``lease`` (``cause``: a loss cause's value)."""
    return Lost(lease.identity.tenant_id, lease.identity.logical_agent_id,
                lease.identity.binding_id, lease.connector_id, lease.epoch, cause, reason)


def store_system(store: object) -> str:
    """What kind of store ``store`` is, for telemetry: its ``db_system`` attribute if it has
    a string one (the shipped stores say ``memory`` and ``postgresql``), else ``other``."""
    declared = getattr(store, "db_system", None)
    return declared if isinstance(declared, str) and declared else "other"


class Emitter:
    """Calls a hook and keeps its failures away from the operation that reported.

    A hook that raises is logged once per event kind (with the traceback), then silently
    ignored for that kind: an exporter that is down must neither break leases nor flood
    the log on every heartbeat.
    """

    __slots__ = ("_failed", "_hook", "_lock")

    def __init__(self, hook: EventHook) -> None:
        self._hook = hook
        self._failed: set[type] = set()
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        try:
            self._hook(event)
        except Exception:
            kind = type(event)
            with self._lock:
                first = kind not in self._failed
                self._failed.add(kind)
            if first:
                log.exception("mos_lease: on_event hook failed on %s; further failures on "
                              "this kind of event are not logged", kind.__name__)


def emitter(on_event: object) -> Emitter | None:
    """The checked ``on_event`` option: ``None``, or a callable wrapped in an
    :class:`Emitter`; anything else is a :class:`~mos_lease.errors.ConfigurationError`."""
    if on_event is None:
        return None
    if isinstance(on_event, Emitter):
        return on_event
    if not callable(on_event):
        raise ConfigurationError(
            f"on_event must be a callable or None, not {type(on_event).__name__}")
    return Emitter(on_event)
