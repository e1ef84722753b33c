"""The size of the keep engine: the lines of the code that keeps leases alive.

Keeping one lease (``hold()``, the keepers) and keeping thousands (the supervisor) is one
engine with thin facades; this figure counts all of it, so that a rule written a second time
shows up as lines. Counted: every ``.py`` file under the engine's folders and the modules it
alone uses, blank lines and comments included (``wc -l``), since both are read.
"""

from __future__ import annotations

from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent

ENGINE = ("mos_lease/keep", "mos_lease/supervisor.py", "mos_lease/keeper.py",
          "mos_lease/holder.py", "mos_lease/held_grant.py")
"""The engine's folder, its public modules and the module it alone uses, relative to the
repository."""


@attrs.frozen
class KeepLines:
    total: int
    per_part: dict[str, int]


def _lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def run(root: Path = ROOT) -> KeepLines:
    """Count the engine's lines; a part that no longer exists counts 0."""
    per_part: dict[str, int] = {}
    for part in ENGINE:
        path = root / part
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
        per_part[part] = sum(_lines(f) for f in files)
    return KeepLines(total=sum(per_part.values()), per_part=per_part)
