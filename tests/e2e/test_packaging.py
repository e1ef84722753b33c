"""The installed distribution's metadata says what a user of the package is told: its licence
as an SPDX expression with the licence text, extras that leave psycopg's libpq binding to
the application, and a core (``attrs`` alone) that runs the README's demo."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _extra(name: str) -> list[Requirement]:
    requirements = [Requirement(text) for text in metadata.requires("mos-lease") or []]
    return [req for req in requirements
            if req.marker is not None and req.marker.evaluate({"extra": name})]


def test_the_licence_is_an_spdx_expression_with_its_text() -> None:
    fields = metadata.metadata("mos-lease")
    assert fields["License-Expression"] == "Apache-2.0"
    assert fields.get_all("License-File") == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a notice


def test_the_pg_extra_leaves_the_libpq_binding_to_the_application() -> None:
    pg = {req.name: req for req in _extra("pg")}
    assert set(pg) == {"psycopg", "psycopg-pool"}
    assert not pg["psycopg"].extras
    (binary,) = _extra("binary")
    assert binary.name == "psycopg" and binary.extras == {"binary"}


def test_dev_brings_the_binary_build_the_docs_and_the_release_tools() -> None:
    dev = {req.name: req for req in _extra("dev")}
    assert {"pg", "binary", "testing", "otel", "docs"} <= dev["mos-lease"].extras
    assert {"build", "twine"} <= set(dev)
    assert {req.name for req in _extra("docs")} == {"mkdocs", "mkdocs-material", "mkdocstrings"}
    assert "python" in next(req for req in _extra("docs") if req.name == "mkdocstrings").extras


def test_the_core_depends_on_attrs_alone() -> None:
    required = [Requirement(text) for text in metadata.requires("mos-lease") or []]
    assert [req.name for req in required if req.marker is None] == ["attrs"]


# Runs ``mos-lease demo`` as the console script does (``mos_lease.cli:main``, its subcommands
# found through the entry points), where only the standard library, attrs and the
# distribution's own packages can be imported: what ``pip install -e .`` alone provides.
_CORE_ONLY_DEMO = r"""
import contextlib, importlib.abc, io, json, sys

OWN = {"mos_lease", "mos_lease_memory", "mos_lease_pg", "mos_lease_tmux"}
ALLOWED = set(sys.stdlib_module_names) | OWN | {"attr", "attrs"}
refused = []

class CoreOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in ALLOWED:
            refused.append(top)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

before = set(sys.modules)
sys.meta_path.insert(0, CoreOnly())
from mos_lease.cli import main

out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["demo"])
loaded = sorted({m.partition(".")[0] for m in set(sys.modules) - before} - ALLOWED)
print(json.dumps({"code": code, "out": out.getvalue(), "refused": sorted(set(refused)),
                  "loaded": loaded}))
"""


def test_the_demo_runs_with_the_core_alone() -> None:
    """The README's first command installs no extra; the demo must not need one."""
    done = subprocess.run([sys.executable, "-c", _CORE_ONLY_DEMO], capture_output=True,
                          text=True, timeout=60, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    ran = json.loads(done.stdout)
    assert ran["code"] == 0, ran
    assert "taken_over" in ran["out"] and "REFUSED: stale_epoch" in ran["out"], ran["out"]
    assert ran["loaded"] == [], ran
    # The PostgreSQL commands' entry points tried psycopg and stood aside, as without the
    # pg extra: the finder really kept the extras out.
    assert "psycopg" in ran["refused"], ran
