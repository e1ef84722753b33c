"""``docs/writing-a-store.md`` is true: its runnable examples run, in order, in one
namespace, and every excerpt marked ``# from <file>`` is that file's text verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "writing-a-store.md"
EXCERPT = re.compile(r"# from (\S+)\n")


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


def test_guide_has_examples_and_excerpts() -> None:
    blocks = _blocks()
    assert sum(1 for b in blocks if EXCERPT.match(b)) >= 2
    assert sum(1 for b in blocks if not EXCERPT.match(b)) >= 3


def test_excerpts_are_verbatim() -> None:
    for block in _blocks():
        marked = EXCERPT.match(block)
        if marked:
            source = (ROOT / marked.group(1)).read_text()
            assert block[marked.end():] in source, f"excerpt drifted from {marked.group(1)}"


def test_examples_run() -> None:
    namespace: dict[str, object] = {"__name__": "guide"}
    for block in _blocks():
        if not EXCERPT.match(block):
            exec(compile(block, str(GUIDE), "exec"), namespace)
