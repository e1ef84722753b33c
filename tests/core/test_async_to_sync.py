"""Each synchronous class is generated from its asyncio source by ``tools/async_to_sync.py``
and is current: the coordinator's facade and the supervisor."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mos_lease import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator
from mos_lease.supervisor import AsyncSupervisor, Supervisor

TOOL = Path(__file__).resolve().parents[2] / "tools" / "async_to_sync.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_to_sync", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("async_to_sync", module)
    spec.loader.exec_module(module)
    return module


# A line of each asyncio source, and where a change to it is marked.
EDITS = {"coordinator": '"""Extend an active lease to store time + ``ttl``',
         "runner": '"""One turn: renew what is due'}


def _target(name: str) -> Any:
    return getattr(_tool(), name.upper())


def test_the_generated_synchronous_classes_are_current() -> None:
    tool = _tool()
    assert {target.source.name for target in tool.TARGETS} == {f"{n}.py" for n in EDITS}
    assert tool.main(["--check"]) == 0


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_change_to_the_asyncio_source_reaches_the_synchronous_class(name: str) -> None:
    tool, target = _tool(), _target(name)
    module = target.source.read_text()
    changed = module.replace(EDITS[name], EDITS[name].replace('"""', '"""CHANGED. '), 1)
    assert changed != module
    regenerated = tool.generated(changed, target)
    assert regenerated.count("CHANGED.") == 2  # the source and its generated twin
    assert tool.generated(regenerated, target) == regenerated


@pytest.mark.parametrize("name", sorted(EDITS))
def test_check_fails_on_a_hand_edit_of_the_generated_class(
        name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    tool, target = _tool(), _target(name)
    module = target.source.read_text()
    head, mark, tail = module.partition(tool.MARK)
    edited = tmp_path / target.source.name
    edited.write_text(head + mark + tail.replace('"""', '"""Edited by hand. ', 1))
    assert edited.read_text() != module
    monkeypatch.setattr(tool, "TARGETS", (target._replace(source=edited),))
    assert tool.main(["--check"]) == 1
    assert f"{edited} is not current" in capsys.readouterr().err
    assert tool.main([]) == 0  # regenerated: the edit is gone, and the file is current again
    assert edited.read_text() == module


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(cls).items()
            if inspect.isfunction(member) and not name.startswith("__")}


def test_both_facades_offer_the_same_operations_with_the_same_signatures() -> None:
    sync, asynchronous = _public(ConnectorLeaseCoordinator), _public(
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


def test_both_supervisors_offer_the_same_methods_with_the_same_signatures() -> None:
    sync, asynchronous = _public(Supervisor), _public(AsyncSupervisor)
    assert sync.keys() == asynchronous.keys()
    for name, signature in sync.items():
        assert list(signature.parameters) == list(asynchronous[name].parameters), name
    waited = {"turn", "issue_grant", "handover", "remove", "close"}
    assert {name for name in asynchronous if not name.startswith("_")
            and inspect.iscoroutinefunction(getattr(AsyncSupervisor, name))} == waited
