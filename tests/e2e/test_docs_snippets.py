"""The documentation is true: every code block in it runs as written (pasting it works).

The pages are ``README.md`` and everything under ``docs/`` but ``docs/_incoming/``; a page
that includes a file of the repository (the READMEs of ``examples/`` and ``mos_lease_pg/``,
the specifications) stands for that file. In each page:

* ``python`` blocks run in order, in one namespace per page, as a reader pasting them one
  after another into one interpreter would;
* ``sh`` blocks run with bash (``-e``, ``-u``, ``-o pipefail``) from the repository root,
  with this interpreter's ``bin`` first on ``PATH`` (so ``python`` and ``mos-lease`` are the
  installed ones);
* a line ``# -> TEXT`` in a block is what it prints: the block's output must contain TEXT;
* a block whose first line is ``# from <path>`` is an excerpt of that file: it must be the
  file's text verbatim, and is not run again;
* ``text`` blocks (output, formulas) and ``mermaid`` ones (diagrams) are not code and never
  run;
* a block preceded by ``<!-- no-run: REASON -->`` is not run; the reason must say why (a
  command that installs the package, one that runs this suite, ...).

Every other fence must be one of these languages. A page whose runnable blocks name
``MOS_LEASE_DSN``, ``ADMIN_DSN`` or ``OWNER_DSN`` runs against a database of its own after
``mos-lease setup`` (fixture ``pg_set_up``, on a cluster of the run's own, since the roles
it makes are cluster-wide): ``ADMIN_DSN`` connects as a superuser, ``OWNER_DSN`` as
``mos_lease_owner`` and ``MOS_LEASE_DSN`` (every ``mos-lease`` command's default ``--dsn``)
as ``mos_lease_gateway``, as gateways do.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

from tests.pg_fixtures import SetUpDatabase

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = frozenset({"python", "sh", "text", "mermaid"})
NOT_CODE = frozenset({"text", "mermaid"})  # output, formulas and diagrams: never run
PG_NAMES = ("MOS_LEASE_DSN", "ADMIN_DSN", "OWNER_DSN")
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                   flags=re.DOTALL | re.MULTILINE)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<reason>[^>]*?)\s*-->\s*\Z")
EXCERPT = re.compile(r"# from (\S+)\n")
EXPECTED = re.compile(r"# -> (.+?)\s*$", flags=re.MULTILINE)


@attrs.frozen
class Block:
    page: Path
    line: int
    language: str
    code: str
    no_run: str | None  # the reason, when marked not to run

    @property
    def excerpt(self) -> str | None:
        marked = EXCERPT.match(self.code)
        return marked.group(1) if marked else None

    @property
    def runs(self) -> bool:
        return self.language not in NOT_CODE and self.no_run is None and self.excerpt is None

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


INCLUDE = re.compile(r'--8<-- "(?P<path>[^"]+)"\n')


def pages() -> list[Path]:
    """The README and every page of the site; a page that only includes a file of the
    repository (``--8<-- "path"``) stands for that file."""
    found = [ROOT / "README.md"]
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if "_incoming" not in page.relative_to(ROOT / "docs").parts:
            include = INCLUDE.fullmatch(page.read_text())
            found.append(ROOT / include.group("path") if include else page)
    return found


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for fence in FENCE.finditer(text):
        before = text[:fence.start()]
        marked = NO_RUN.search(before)
        indent = len(fence.group("indent"))
        body = textwrap.dedent(fence.group("body")) if indent else fence.group("body")
        found.append(Block(page, before.count("\n") + 1, fence.group("lang").strip(), body,
                           marked.group("reason") if marked else None))
    return found


def needs_pg(page: Path) -> bool:
    return any(name in block.code for block in blocks(page) if block.runs for name in PG_NAMES)


def _params() -> list[object]:
    return [pytest.param(page, id=str(page.relative_to(ROOT)),
                         marks=[pytest.mark.pg] if needs_pg(page) else [])
            for page in pages() if any(block.runs for block in blocks(page))]


def test_every_fence_is_known_and_every_skip_says_why() -> None:
    counted = {"run": 0, "no-run": 0, "excerpt": 0, "text": 0}
    for page in pages():
        for block in blocks(page):
            assert block.language in LANGUAGES, (
                f"{block.where()}: fence language {block.language!r} is not one of "
                f"{sorted(LANGUAGES)}")
            if block.no_run is not None:
                assert len(block.no_run) >= 10, f"{block.where()}: say why it does not run"
                assert block.language not in NOT_CODE, f"{block.where()}: never runs anyway"
            kind = ("excerpt" if block.excerpt else "text" if block.language in NOT_CODE
                    else "no-run" if block.no_run is not None else "run")
            counted[kind] += 1
    # Most of the documentation's code runs; a page of illustrations alone would not.
    assert counted["run"] >= 30 and counted["no-run"] <= counted["run"] // 4, counted


def test_excerpts_are_verbatim() -> None:
    seen = 0
    for page in pages():
        for block in blocks(page):
            if block.excerpt is not None:
                source = (ROOT / block.excerpt).read_text()
                assert block.code[len(f"# from {block.excerpt}\n"):] in source, (
                    f"{block.where()}: excerpt drifted from {block.excerpt}")
                seen += 1
    assert seen >= 2


def _expected(block: Block, output: str) -> None:
    for wanted in EXPECTED.findall(block.code):
        assert wanted in output, f"{block.where()}: printed no {wanted!r}:\n{output[-3000:]}"


def _run_python(block: Block, namespace: dict[str, object]) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block.code, block.where(), "exec"), namespace)
    _expected(block, printed.getvalue())


def _run_sh(block: Block, environ: dict[str, str]) -> None:
    env = {**os.environ, **environ,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{block.where()}: exit {done.returncode}:\n{output[-3000:]}"
    _expected(block, output)


@pytest.mark.parametrize("page", _params())
def test_page_runs(page: Path, request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    environ: dict[str, str] = {}
    if needs_pg(page):
        database: SetUpDatabase = request.getfixturevalue("pg_set_up")
        environ = database.environ()
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
    namespace: dict[str, object] = {"__name__": "__doc__"}
    ran = 0
    for block in blocks(page):
        if block.runs:
            if block.language == "python":
                _run_python(block, namespace)
            else:
                _run_sh(block, environ)
            ran += 1
    assert ran > 0


def test_layout_matches_the_tree() -> None:
    """``docs/layout.md`` names every top-level directory of the project, and every module
    of the packages in its package's row."""
    rows = {}
    for line in (ROOT / "docs" / "layout.md").read_text().splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) >= 2:
            for path in re.findall(r"`([^`]+)`", cells[0]):
                rows[path.rstrip("/")] = cells[1]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    top = {path.split("/")[0] for path in tracked if "/" in path}
    missing_dirs = sorted(name for name in top if name not in rows)
    assert not missing_dirs, f"docs/layout.md does not name {missing_dirs}"
    for package in ("mos_lease", "mos_lease_pg", "mos_lease_memory", "mos_lease_tmux"):
        # A module directly in the package by its name, a subpackage or folder by its own.
        modules = {Path(path).stem if path.count("/") == 1 else path.split("/")[1]
                   for path in tracked if path.startswith(f"{package}/")
                   and (path.endswith(".py") or path.count("/") >= 2)
                   and not Path(path).name.startswith("__")}
        unnamed = sorted(m for m in modules if f"`{m}" not in rows[package])
        assert not unnamed, f"docs/layout.md: the {package}/ row does not name {unnamed}"


def test_readme_links_resolve() -> None:
    """The READMEs are read outside the site (on a forge, in the sdist): their relative
    links must name files of the repository. (``mkdocs build --strict`` checks the site's.)"""
    checked = 0
    for readme in (ROOT / "README.md", ROOT / "examples" / "README.md",
                   ROOT / "mos_lease_pg" / "README.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", readme.read_text()):
            if "://" in target or target.startswith("#"):
                continue
            path = (readme.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{readme.relative_to(ROOT)}: broken link {target}"
            checked += 1
    assert checked >= 10


def test_store_readme_names_every_migration_and_tested_version() -> None:
    readme = (ROOT / "mos_lease_pg" / "README.md").read_text()
    shipped = ROOT / "mos_lease_pg" / "sql" / "migrations"
    migrations = sorted(path.name for path in shipped.glob("*.sql"))
    assert len(migrations) >= 3
    assert [m for m in migrations if f"`{m}`" not in readme] == []
    assert "tested on 15 and 18" in " ".join(readme.split())


README_MAX_LINES = 200  # a newcomer reads it in five minutes; the rest is the site's


def test_the_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, over {README_MAX_LINES}: move detail into docs/")


def _quick_start(page: Path) -> list[str]:
    (block,) = [b for b in blocks(page) if b.language == "sh" and "mos-lease demo" in b.code
                and "pytest" in b.code]
    return block.code.splitlines()


def _installs(command: str) -> list[str]:
    """What each ``pip install`` of ``command`` installs (its arguments but ``-q``)."""
    return [" ".join(arg for arg in found.split() if arg != "-q")
            for found in re.findall(r"pip install ([^&\n]+?)\s*(?:&&|$)", command,
                                     flags=re.MULTILINE)]


def test_the_quick_start_runs_the_demo_on_the_core_and_the_tests_on_dev() -> None:
    """Command 1 installs the package without any extra (the demo needs only ``attrs``:
    tests/e2e/test_packaging.py runs it so), command 2 the ``dev`` extra and the tests; the
    getting-started page says the same, and CI installs and runs what command 2 does."""
    first, second = _quick_start(ROOT / "README.md")
    assert _quick_start(ROOT / "docs" / "getting-started.md") == [first, second]
    assert _installs(first) == ["-e ."], first
    assert "[" not in first and first.endswith(".venv/bin/mos-lease demo"), first
    assert _installs(second) == ["-e '.[dev]'"], second
    assert second.endswith(".venv/bin/python -m pytest"), second
    ci = (ROOT / ".ci" / "run").read_text()
    assert [line for line in _installs(ci) if ".[" in line] == ["-e '.[dev]'"]
    # CI may ask for the slowest tests' timings; nothing else may differ from command 2.
    assert re.search(r"\npython -m pytest -q( --durations=[0-9]+)?\n", ci), ci
