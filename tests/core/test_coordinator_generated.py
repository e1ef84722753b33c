"""The synchronous coordinator is generated from the asyncio one and is current."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

from mos_lease import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator

TOOL = Path(__file__).resolve().parents[2] / "tools" / "async_to_sync.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_to_sync", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("async_to_sync", module)
    spec.loader.exec_module(module)
    return module


def test_the_generated_synchronous_coordinator_is_current() -> None:
    tool = _tool()
    assert tool.main(["--check"]) == 0


def test_a_change_to_the_asyncio_source_reaches_the_synchronous_class() -> None:
    tool = _tool()
    module = tool.SOURCE.read_text()
    changed = module.replace('"""Extend an active lease to store time + ``ttl``',
                             '"""CHANGED. Extend an active lease to store time + ``ttl``', 1)
    assert changed != module
    regenerated = tool.generated(changed)
    assert regenerated.count("CHANGED.") == 2  # the source and its generated twin
    assert tool.generated(regenerated) == regenerated


def test_both_facades_offer_the_same_operations_with_the_same_signatures() -> None:
    def public(cls: type) -> dict[str, inspect.Signature]:
        return {name: inspect.signature(member) for name, member in vars(cls).items()
                if inspect.isfunction(member) and not name.startswith("__")}

    sync, asynchronous = public(ConnectorLeaseCoordinator), public(
        AsyncConnectorLeaseCoordinator)
    assert sync.keys() == asynchronous.keys()
    for name, signature in sync.items():
        assert list(signature.parameters) == list(asynchronous[name].parameters), name
    # A primer checks and builds now and returns the rest of the call, to be awaited.
    primers = {"prime_heartbeat_many"}
    assert all(inspect.iscoroutinefunction(getattr(AsyncConnectorLeaseCoordinator, name))
               for name in asynchronous if name not in primers)
    assert not any(inspect.iscoroutinefunction(getattr(AsyncConnectorLeaseCoordinator, name))
                   for name in primers)
