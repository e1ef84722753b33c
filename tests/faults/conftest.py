"""Fixtures of the fault, race and attack scenarios.

``pytest -m faults`` runs the short version of every scenario; ``--soak`` (or
``MOS_LEASE_SOAK=1``) runs the full counts. pytest only reads options from the
conftest files it loads at start-up, so the ``--soak`` option itself is registered in
``tests/conftest.py``.

Each scenario fills a figures table; the tables are printed as the scenarios finish with
``-s``, in the terminal summary otherwise, and appended to ``figures-{short,soak}.md`` (and
``.jsonl``) in ``$MOS_LEASE_FAULTS_DIR`` if set (emptied first), else in this pytest
session's own temporary directory (so concurrent runs never mix their tables); the terminal
summary names the file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.faults.support import Table, save_table
from tests.pg_support import in_schema

_TABLES = pytest.StashKey[list[Table]]()
_DIR = pytest.StashKey[Path]()


@pytest.fixture(scope="session")
def soak(request: pytest.FixtureRequest) -> bool:
    """True for the long run (the full counts), False for the short CI run."""
    option = bool(request.config.getoption("--soak", default=False))
    return option or os.environ.get("MOS_LEASE_SOAK", "") not in ("", "0")


@pytest.fixture(scope="session")
def figures_dir(request: pytest.FixtureRequest, soak: bool,
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this session's figures files go."""
    given = os.environ.get("MOS_LEASE_FAULTS_DIR")
    directory = Path(given) if given else tmp_path_factory.getbasetemp() / "faults-figures"
    mode = "soak" if soak else "short"
    for suffix in ("md", "jsonl"):
        (directory / f"figures-{mode}.{suffix}").unlink(missing_ok=True)
    request.config.stash[_DIR] = directory
    return directory


@pytest.fixture
def figures(request: pytest.FixtureRequest, soak: bool, figures_dir: Path) -> Iterator[Table]:
    """The scenario's figures table: printed and saved when the test ends, pass or fail."""
    module = request.node.module
    doc = (module.__doc__ or request.node.name).strip().splitlines()[0]
    table = Table(scenario=doc.rstrip("."), mode="soak" if soak else "short")
    began = time.monotonic()
    yield table
    table.seconds = time.monotonic() - began
    save_table(table, figures_dir)
    stash = request.config.stash.setdefault(_TABLES, [])
    stash.append(table)
    if request.config.getoption("capture") == "no":
        print("\n" + table.render(), flush=True)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    tables = config.stash.get(_TABLES, [])
    if not tables:
        return
    if config.getoption("capture") == "no":
        # The tables were printed as each scenario ended; just say where they are saved.
        directory = config.stash.get(_DIR, None)
        if directory is not None:
            terminalreporter.write_line(f"fault scenario figures saved in {directory}")
        return
    terminalreporter.section("fault scenario figures")
    for table in tables:
        for line in table.render().splitlines():
            terminalreporter.write_line(line)
        terminalreporter.write_line("")
    directory = config.stash.get(_DIR, None)
    if directory is not None:
        terminalreporter.write_line(f"figures saved in {directory}")


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit superuser connection to the run's database (the checker's reads and the
    scenarios' direct manipulations go through it, never through the store under test). Its
    search_path finds the library's schema for that SQL; the stores under test use none."""
    with psycopg.connect(in_schema(pg_dsn, "public,mos_lease"), autocommit=True,
                         application_name="faults-admin") as conn:
        yield conn
