"""The documentation's diagrams say what the library does: the lease's state diagram is the
one ``tools/lease_diagram.py`` draws from ``specs/transitions.md`` (the table the code is
tested against), and every call, outcome and reason a sequence diagram names is a real one."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

import attrs
import pytest

import mos_lease
import mos_lease.machine
from mos_lease import ConnectorLeaseCoordinator, ResourceGuard
from mos_lease.fencing import FenceReason, GuardDecision
from mos_lease.ports import LeaseStore
from mos_lease.records import LeaseRow
from mos_lease.vocabulary import LeaseState, Outcome, Reason

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "lease_diagram.py"
PAGES = (ROOT / "README.md", ROOT / "docs" / "concepts.md")
MERMAID = re.compile(r"^```mermaid\n(.*?)^```$", re.M | re.S)


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lease_diagram", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("lease_diagram", module)
    spec.loader.exec_module(module)
    return module


def _diagrams(kind: str) -> list[tuple[Path, str]]:
    return [(page, body) for page in PAGES for body in MERMAID.findall(page.read_text())
            if body.startswith(kind + "\n")]


def test_the_pages_embed_the_state_diagram_of_the_table() -> None:
    assert [page for page, _ in _diagrams("stateDiagram-v2")] == list(PAGES)
    assert [page for page, _ in _diagrams("sequenceDiagram")] == list(PAGES)
    assert _tool().main(["--check", *map(str, PAGES)]) == 0


def test_a_change_to_the_table_shows_as_a_stale_diagram(tmp_path: Path) -> None:
    tool = _tool()
    rows = tool.lifecycle()
    # A release that left the lease expired instead of released, as a table edit would say.
    edited = [[*row[:5], "renew" if row[0] == "release" and row[5] == "close" else row[5],
               row[6]] for row in rows]
    assert edited != rows
    drifted = tool.diagram(edited)
    assert drifted != tool.diagram(rows)
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n```mermaid\n{drifted}```\n\nAfter.\n")
    assert tool.main(["--check", str(page)]) == 1
    assert tool.main(["--write", str(page)]) == 0
    assert tool.embedded(page.read_text()) == tool.diagram(rows)
    assert page.read_text().endswith("```\n\nAfter.\n")
    assert tool.main(["--check", str(page)]) == 0


def test_the_state_diagram_draws_every_write_of_the_table_between_real_states() -> None:
    tool = _tool()
    rows = tool.lifecycle()
    drawn = tool.diagram(rows).splitlines()[1:]
    edges = {tuple(state.strip() for state in line.split(" : ")[0].split(" --> ")):
             line.split(" : ")[1].split("<br>") for line in drawn}
    assert len(edges) == len(drawn)  # one edge per pair of states
    assert {state for edge in edges for state in edge} - {"[*]"} == set(map(str, LeaseState))
    labels = [label for edge in edges.values() for label in edge]
    writes = [row for row in rows if row[5] != "none"]
    assert len(labels) == len(writes) + 1  # and the expiry, which no command makes
    assert edges[("active", "expired")] == ["expires"]
    leaves = {"insert": "active", "rotate": "active", "renew": "active", "close": "released"}
    for command, state, condition, _, _, write, _ in writes:
        edge = edges[("[*]" if state == "absent" else state, leaves[write])]
        assert any(label.startswith(command) and (condition in label) == (
            condition not in ("-", "match")) for label in edge), (command, state, condition)


def _vocabulary() -> set[str]:
    """The snake_case names a diagram may use: the library's outcomes, reasons, calls, their
    parameters, and the fields of what they return."""
    names = {str(value) for enum in (Outcome, Reason, FenceReason) for value in enum}
    for kind in (ConnectorLeaseCoordinator, ResourceGuard, LeaseStore):
        for name, member in inspect.getmembers(kind, callable):
            if not name.startswith("_"):
                names.add(name)
                names |= set(inspect.signature(member).parameters)
    names |= {field.name for kind in (GuardDecision, LeaseRow) for field in attrs.fields(kind)}
    return names


def _callee(participant: str, labels: dict[str, str]) -> type:
    label = labels.get(participant, participant)
    for word, kind in (("gateway", ConnectorLeaseCoordinator), ("store", LeaseStore),
                       ("resource", ResourceGuard)):
        if word in label:
            return kind
    return type(None)  # a connector: it is called by nobody


MESSAGE = re.compile(r"^\s*(?P<source>\w+)(?P<arrow>-?->>)(?P<target>\w+): (?P<text>.*)$")


@pytest.mark.parametrize(("page", "body"), _diagrams("sequenceDiagram"),
                         ids=lambda value: value.name if isinstance(value, Path) else "")
def test_a_sequence_diagram_names_only_real_calls_outcomes_and_reasons(page: Path,
                                                                        body: str) -> None:
    labels = dict(re.findall(r"participant (\w+) as (.+)", body))
    known = _vocabulary()
    messages = [found for line in body.splitlines() if (found := MESSAGE.match(line))]
    assert len(messages) >= 8, page
    for message in messages:
        text = message["text"]
        first = re.match(r"\w+", text)
        assert first is not None, text
        if message["arrow"] == "->>":  # a call: a method of what it calls
            assert hasattr(_callee(message["target"], labels), first[0]), text
        elif _callee(message["source"], labels) is ResourceGuard:  # a guard's decision
            assert first[0] in {"ok", *map(str, FenceReason)}, text
        else:  # a coordinator's result: its outcome first
            assert first[0] in set(map(str, Outcome)), text
    named = body.split("\n", 1)[1]
    unknown = set(re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", named)) - known
    assert unknown == set(), page
    for word in re.findall(r"\b[A-Z][a-z]+[A-Z]\w*\b|\b(?:Insert|Rotate|Renew|Close)\b", named):
        assert hasattr(mos_lease, word) or hasattr(mos_lease.machine, word), word
    # The story: the stale connector is refused stale_epoch at the gateway and downstream.
    refused = [m for m in messages if m["arrow"] == "-->>" and "stale_epoch" in m["text"]]
    assert {_callee(m["source"], labels) for m in refused} == {ConnectorLeaseCoordinator,
                                                                ResourceGuard}
