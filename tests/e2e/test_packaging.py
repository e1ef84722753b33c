"""The installed distribution's metadata says what a user of the package is told: its licence
as an SPDX expression with the licence text, and extras that leave psycopg's libpq binding
to the application."""

from __future__ import annotations

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
