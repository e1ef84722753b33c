"""Draw the lease's states and transitions (Mermaid ``stateDiagram-v2``) from the Lifecycle
table of ``specs/transitions.md``, read by the parser ``tests/core/test_spec_table.py``
checks the code against.

    python tools/lease_diagram.py                     # print the diagram
    python tools/lease_diagram.py --check FILE...     # exit 1 unless each FILE embeds it
    python tools/lease_diagram.py --write FILE...     # rewrite the embedded copy in each FILE

A transition is each table row that writes (``insert``, ``rotate``, ``renew``, ``close``):
its command (and condition) from the row's state to the state the write leaves (``absent``,
no row, is the start ``[*]``), with the epoch it leaves when it sets one. Refusals write
nothing and change no state, so they are not drawn. The one change no command makes, an
active lease's expiry passing in store time, is drawn from the table's definition of the
states.

In a page the diagram is the ``mermaid`` fence whose first line is ``stateDiagram-v2``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
PARSER: Final = ROOT / "tests" / "core" / "test_spec_table.py"
# The state each write leaves the row in (the table's "write" column).
LEAVES: Final = {"insert": "active", "rotate": "active", "renew": "active",
                 "close": "released"}
# The audit epoch a success records is the epoch the lease is left at.
EPOCHS: Final = {"1": "epoch 1", "expected+1": "epoch + 1"}
EXPIRY: Final = "active --> expired : expires"
_EMBEDDED = re.compile(r"^```mermaid\n(?P<diagram>stateDiagram-v2\n.*?)^```$", re.M | re.S)


def lifecycle() -> list[list[str]]:
    """The rows of the Lifecycle table, as the specification's test reads them."""
    spec = importlib.util.spec_from_file_location("_spec_table", PARSER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows: list[list[str]] = module.LIFECYCLE
    return rows


def diagram(rows: list[list[str]]) -> str:
    """The Mermaid text of the transitions that ``rows`` (the Lifecycle table) write."""
    edges: dict[tuple[str, str], list[str]] = {}
    for command, state, condition, _, _, write, audit_epoch in rows:
        if write not in LEAVES:
            continue
        label = command + ("" if condition in ("-", "match") else f" if {condition}")
        label += f", {EPOCHS[audit_epoch]}" if audit_epoch in EPOCHS else ""
        source = "[*]" if state == "absent" else state
        # One edge per pair of states: Mermaid draws a second loop over the first. Labels are
        # kept to a line each: longer ones overlap in Mermaid's layout of these few states.
        edges.setdefault((source, LEAVES[write]), []).append(label)
    lines = ["stateDiagram-v2"]
    lines += [f"    {source} --> {target} : {'<br>'.join(labels)}"
              for (source, target), labels in edges.items()]
    lines.append(f"    {EXPIRY}")
    return "\n".join(lines) + "\n"


def embedded(page: str) -> str | None:
    """The state diagram ``page`` embeds, if it does."""
    found = _EMBEDDED.search(page)
    return found["diagram"] if found else None


def main(argv: list[str]) -> int:
    current = diagram(lifecycle())
    if not argv:
        sys.stdout.write(current)
        return 0
    mode, files = argv[0], [Path(name) for name in argv[1:]]
    if mode not in ("--check", "--write") or not files:
        sys.stderr.write(__doc__ or "")
        return 2
    stale = 0
    for path in files:
        page = path.read_text()
        if embedded(page) is None:
            sys.stderr.write(f"{path}: no mermaid fence starting stateDiagram-v2\n")
            stale += 1
        elif embedded(page) != current:
            if mode == "--write":
                path.write_text(_EMBEDDED.sub(lambda _: f"```mermaid\n{current}```", page,
                                              count=1))
            else:
                sys.stderr.write(f"{path}: the diagram differs from specs/transitions.md; "
                                 "run python tools/lease_diagram.py --write FILE\n")
                stale += 1
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
