"""What the ``on_event`` hook costs when nothing is attached: validate on the in-memory store.

The in-memory store makes a validation as cheap as it gets (no network, no SQL), so the one
``is None`` check the driver gained for the hook is as large a share of the call as it can
ever be. Three coordinators share one store and run in the same interleaved rounds:

* ``hook path, none attached``: the library's coordinator as shipped, ``on_event=None``;
* ``no hook path``: the same coordinator with its driver (``flowdrive.Drive``) run without
  the check (the floor);
* ``no-op hook attached``: ``on_event=lambda event: None``, for information: the price of
  timing every store call and building the events, paid only by those who attach a hook;
* ``hand-written loop``: for information, the driver as each coordinator wrote it before
  ``flowdrive`` (a generator loop of its own, no check): what the one shared driver costs.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, TypeVar

import attrs
from measure import Case, Series, interleave, throughput_ratio

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.clock import ManualClock
from mos_lease.errors import MosLeaseError
from mos_lease.flowdrive import Drive, outcome_of
from mos_lease.store_ops import Flow
from mos_lease.store_ops import perform as _call
from mos_lease_memory import InMemoryLeaseStore

T = TypeVar("T")

SCOPES = ("tool:run",)


class _NoHookPath(ConnectorLeaseCoordinator):
    """The synchronous driver without the hook check and without counting the operation
    (``stats()``): the floor this figure divides by."""

    def _run(self, flow: Flow[T], _operation: str = "") -> T:
        drive = Drive(flow)
        for op in drive:
            drive.send(outcome_of(_call, self.store, op))
        return drive.result


class _HandLoop(ConnectorLeaseCoordinator):
    """The driver as it was written in each coordinator before ``flowdrive``."""

    def _run(self, flow: Flow[T], _operation: str = "") -> T:
        try:
            op = next(flow)
            while True:
                try:
                    result = _call(self.store, op)
                except MosLeaseError as failure:
                    op = flow.throw(failure)
                else:
                    op = flow.send(result)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


@attrs.frozen
class TelemetryResult:
    series: dict[str, Series]
    ratio: float  # hook path, none attached / no hook path
    attached_ratio: float  # no-op hook attached / no hook path
    hand_ratio: float  # no hook path / hand-written loop: the shared driver's price


NONE_ATTACHED = "hook path, none attached"
NO_HOOK_PATH = "no hook path"
ATTACHED = "no-op hook attached"
HAND_LOOP = "hand-written loop"


def _validate_case(name: str, coordinator: ConnectorLeaseCoordinator,
                   identity: LeaseIdentity) -> Case:
    lease = coordinator.acquire(identity, "bench", scopes=SCOPES, ttl=300).lease
    assert lease is not None
    grant = coordinator.issue_grant(lease, scopes=SCOPES, ttl=30).grant
    assert grant is not None
    validate = coordinator.validate

    def call(_i: int) -> None:
        if not validate(grant, identity=identity, scopes=SCOPES).ok:
            raise AssertionError(f"{name}: validation refused")

    return Case(name, call)


def run(*, rounds: int, per_round: int, warmup: int) -> TelemetryResult:
    # A manual clock: the grants never expire however long the machine takes.
    store = InMemoryLeaseStore(ManualClock(datetime(2030, 1, 1, tzinfo=UTC)))
    policy = AllowAllPolicy()
    noop: Any = lambda _event: None  # noqa: E731
    cases = [
        _validate_case(NONE_ATTACHED, ConnectorLeaseCoordinator(store, policy),
                       LeaseIdentity("bench", "agent", "checked")),
        _validate_case(NO_HOOK_PATH, _NoHookPath(store, policy),
                       LeaseIdentity("bench", "agent", "floor")),
        _validate_case(ATTACHED, ConnectorLeaseCoordinator(store, policy, on_event=noop),
                       LeaseIdentity("bench", "agent", "attached")),
        _validate_case(HAND_LOOP, _HandLoop(store, policy),
                       LeaseIdentity("bench", "agent", "hand")),
    ]
    series = interleave(cases, rounds=rounds, per_round=per_round, warmup=warmup)
    return TelemetryResult(series, throughput_ratio(series[NONE_ATTACHED], series[NO_HOOK_PATH]),
                           throughput_ratio(series[ATTACHED], series[NO_HOOK_PATH]),
                           throughput_ratio(series[NO_HOOK_PATH], series[HAND_LOOP]))
