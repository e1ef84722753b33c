"""Modules stay small enough to say what they hold: no module of the four packages is over
:data:`LIMIT` lines, but for those in :data:`ALLOWED`, each with the reason it is one idea
that splitting would only scatter. A module that grows past the limit is split along its
ideas (``docs/layout.md`` names every module); an allowed one that shrank below the limit
leaves the list. The files are read as text: nothing is imported, so this runs in the core's
room, without psycopg."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mos_lease", "mos_lease_pg", "mos_lease_memory", "mos_lease_tmux")
LIMIT = 400

# Module (relative to the project root) -> why it is one idea, kept whole above the limit.
ALLOWED: dict[str, str] = {
    "mos_lease/coordinator.py": "the two facades and nothing else: the asyncio class, and the "
    "synchronous class tools/async_to_sync.py generates from it, kept in one file so that "
    "--check compares them",
    "mos_lease/keep/runner.py": "the two supervisors and nothing else: the asyncio "
    "class, and the thread class tools/async_to_sync.py generates from it, kept in one file "
    "so that --check compares them (as the coordinator's facades)",
    "mos_lease/machine.py": "the protocol's state machine: the commands, the writes they plan "
    "and every decision on them, the functions specs/transitions.md tabulates and its table "
    "test reads from this one module",
    "mos_lease_pg/store.py": "the PostgreSQL stores' call path: the synchronous and the "
    "asyncio store operation by operation, differing only in await, read side by side as the "
    "coordinator's two facades are (everything they share is in store_core)",
    "mos_lease_pg/coalesce.py": "coalesced calls of one store: the two queues (reads and "
    "audit appends) and the pump that sends each batch, written once for the thread and the "
    "asyncio store, with the rules that keep each caller's answer its own",
    "mos_lease/keep/holding.py": "hold()'s two holders over the keep engine and nothing "
    "else: what both read off the engine's reports, and the thread and asyncio shells, which "
    "differ in how the block waits, is left and is cancelled on loss",
    "mos_lease/keep/schedule.py": "the supervisor's pure schedule: one object deciding, "
    "for every binding, what is due and what each call's outcome means (renewal, campaign, "
    "confirming read); its values live apart in slots and changes",
}


def oversized(root: Path, packages: Iterable[str]) -> dict[str, int]:
    """Every module of ``packages`` under ``root`` over :data:`LIMIT` lines, with its count."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text("utf-8").splitlines())
            if lines > LIMIT:
                found[path.relative_to(root).as_posix()] = lines
    return found


def test_no_module_is_over_the_limit_unless_allowed() -> None:
    over = oversized(ROOT, PACKAGES)
    assert {path: lines for path, lines in over.items() if path not in ALLOWED} == {}


def test_every_allowed_module_is_still_over_the_limit_and_says_why() -> None:
    over = oversized(ROOT, PACKAGES)
    assert [path for path in ALLOWED if path not in over] == []
    assert [path for path, why in ALLOWED.items() if not why.strip()] == []


def test_the_count_finds_a_module_over_the_limit_wherever_it_is(tmp_path: Path) -> None:
    nested = tmp_path / "mos_lease_pg" / "admin"
    nested.mkdir(parents=True)
    (nested / "big.py").write_text("x = 1\n" * (LIMIT + 1))
    (nested / "fits.py").write_text("x = 1\n" * LIMIT)
    (tmp_path / "mos_lease").mkdir()
    (tmp_path / "mos_lease" / "top.py").write_text("x = 1\n" * (LIMIT + 7))
    assert oversized(tmp_path, ("mos_lease", "mos_lease_pg")) == {
        "mos_lease/top.py": LIMIT + 7, "mos_lease_pg/admin/big.py": LIMIT + 1}


def test_the_packages_checked_are_the_projects() -> None:
    assert all((ROOT / package / "__init__.py").is_file() for package in PACKAGES)
