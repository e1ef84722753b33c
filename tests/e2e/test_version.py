"""``mos_lease.__version__`` is the installed distribution's, which is pyproject.toml's."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import mos_lease
from mos_lease import version

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_installed_metadata_and_the_projects() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert mos_lease.__version__ == metadata.version("mos-lease") == declared
    from mos_lease import __version__

    assert __version__ == declared


def test_a_source_tree_never_installed_reports_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert mos_lease.__version__ == version.UNKNOWN == "0+unknown"


def test_other_missing_names_still_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = mos_lease.no_such_name  # type: ignore[attr-defined]


def test_the_command_reports_the_same_version() -> None:
    done = subprocess.run([sys.executable, "-m", "mos_lease.cli", "--version"],
                          capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == f"mos-lease {mos_lease.__version__}"
