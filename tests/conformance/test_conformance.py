"""The conformance kit, run against every shipped store through one fixture."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from mos_lease.testing import (
    make_fleet_machine,
    make_lease_machine,
    make_supervisor_machine,
    run_store_contract,
)
from tests.conformance.conftest import HarnessFactory


def test_store_contract(harness_factory: HarnessFactory) -> None:
    run_store_contract(harness_factory, steps=400)


def test_lease_state_machine(harness_factory: HarnessFactory) -> None:
    machine = make_lease_machine(harness_factory)
    machine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()


def test_supervisor_state_machine(harness_factory: HarnessFactory) -> None:
    machine = make_supervisor_machine(harness_factory)
    machine.TestCase.settings = settings(
        max_examples=80, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()


def test_fleet_state_machine(harness_factory: HarnessFactory) -> None:
    # A small budget: the in-memory store runs it at length in tests/core.
    machine = make_fleet_machine(harness_factory)
    machine.TestCase.settings = settings(
        max_examples=6, stateful_step_count=20, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()
