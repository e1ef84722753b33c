"""Nothing secret reaches OpenTelemetry: the canaries of ``tests/core/test_audit_privacy.py``
(every lease UUID and grant MAC included) are in no event, keeper log record, span or metric
attribute."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mos_lease import LeaseKeeper, Reason
from mos_lease.events import Event
from mos_lease.otel import OpenTelemetryHook
from tests.core.test_audit_privacy import (
    CANARY_GRANT_SCOPE,
    CANARY_SCOPE,
    SecretHoldingPolicy,
    _assert_no_canary,
    _run_everything_with_canaries,
)
from tests.core.test_keeper import make_rig
from tests.helpers import IDENT, OTHER_IDENT, Env, make_env


def _secrets_of(env: Env, grants: list[Any]) -> list[str]:
    """Every lease UUID the store ever held and every grant's id and MAC, as text."""
    found: list[str] = []
    for row in env.rows():
        found += [str(row.lease_id), row.lease_id.hex]
    for grant in grants:
        found += [str(grant.grant_id), grant.grant_id.hex, grant._mac.hex(), repr(grant._mac)]
    return found


def _assert_none_of(secrets: list[str], text: str, where: str) -> None:
    _assert_no_canary(text, where)
    for secret in secrets:
        assert secret not in text, f"{secret!r} leaked into {where}"


def test_canaries_never_reach_events_keeper_logs_or_opentelemetry(
        caplog: pytest.LogCaptureFixture) -> None:
    reader, spans = InMemoryMetricReader(), InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(spans))
    otel = OpenTelemetryHook(MeterProvider(metric_readers=[reader]), tracers)
    events: list[Event] = []

    def hook(event: Event) -> None:
        events.append(event)
        otel(event)

    caplog.set_level(logging.DEBUG, logger="mos_lease")
    env = make_env(SecretHoldingPolicy(), on_event=hook)
    _run_everything_with_canaries(env)
    other = env.acquire(OTHER_IDENT, scopes=[CANARY_GRANT_SCOPE])
    grant = env.coordinator.issue_grant(other, scopes=[CANARY_GRANT_SCOPE], ttl=5).grant
    assert grant is not None and env.coordinator.validate(
        grant, identity=OTHER_IDENT, scopes=[CANARY_GRANT_SCOPE]).ok
    grants = [grant]
    # A keeper holding canary scopes: renewals, retries with their cause, loss.
    rig = make_rig()
    keeper: LeaseKeeper = rig.keeper(on_event=hook)
    assert keeper.acquire(IDENT, "conn-k", scopes=[CANARY_SCOPE]).ok
    keeper.step()
    keeper.step()
    rig.faulty.mode = "down"
    while not keeper.lost.is_set():
        keeper.step()
    assert keeper.issue_grant(scopes=[CANARY_SCOPE], ttl=5).reason is Reason.LEASE_EXPIRED

    kinds = {type(e).__name__ for e in events}
    assert kinds == {"OperationFinished", "StoreCall", "Renewed", "RenewalRetry", "Lost"}
    secrets = _secrets_of(env, grants) + [
        s for row in rig.store.leases() for s in (str(row.lease_id), row.lease_id.hex)]
    for event in events:
        _assert_none_of(secrets, repr(event), f"a {type(event).__name__} event")
    # The keeper's renewals, retries and loss are logged by the engine it runs on, its
    # local grant refusal by the keeper.
    keeper_lines = [r for r in caplog.records
                    if r.name in {"mos_lease.keeper", "mos_lease.supervisor"}]
    assert {r.levelno for r in keeper_lines} >= {logging.DEBUG, logging.INFO, logging.WARNING}
    for record in caplog.records:
        if record.name.startswith("mos_lease"):
            _assert_none_of(secrets, f"{record.getMessage()} {record.threadName} "
                                     f"{record.args!r}", "a log record")
    finished = spans.get_finished_spans()
    assert finished
    data = reader.get_metrics_data()
    assert data is not None
    values = [repr(dict(s.attributes or {})) + s.name for s in finished]
    values += [repr(dict(p.attributes or {})) for rm in data.resource_metrics
               for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points]
    for text in values:
        _assert_none_of(secrets, text, "an OpenTelemetry attribute")
    # The check can fail: the secrets really are what a careless line would print.
    with pytest.raises(AssertionError):
        _assert_none_of(secrets, repr(env.rows()[0]), "a row")
