"""Every public name has a docstring, so the API reference (generated from the docstrings
by mkdocstrings, ``docs/reference/``) documents all of it: each name in the public packages'
``__all__``, each name the reference renders from a submodule (the core's top level is kept
small; the rest is imported from the module named for what it holds), and each public
method and property those classes define."""

from __future__ import annotations

import enum
import html
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import griffe
import pytest

PUBLIC = ("mos_lease", "mos_lease_pg", "mos_lease_pg.admin", "mos_lease_memory",
          "mos_lease.testing")
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"


# A block of a reference page: ``::: module``, then its options, perhaps a ``members`` list.
_BLOCK = re.compile(r"^::: (\S+)\n((?:    .*\n|\s*\n)*)", re.M)


def _rendered(page: str = "*.md") -> dict[str, list[str] | None]:
    """Each module the reference renders, with the members it lists (``None``: all)."""
    pages = "\n".join(path.read_text() for path in sorted(REFERENCE.glob(page)))
    return {match[1]: re.findall(r"^        - (\w+)$", match[2], re.M) or None
            for match in _BLOCK.finditer(pages + "\n")}


def _undocumented(module_name: str, names: list[str] | None = None) -> list[str]:
    module = importlib.import_module(module_name)
    names = names or getattr(module, "__all__", None) or [  # else what the module defines
        name for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module_name]
    missing = []
    for name in names:
        value = getattr(module, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if not (value.__doc__ or "").strip():
            missing.append(name)
        if not inspect.isclass(value) or issubclass(value, enum.Enum):
            continue
        for attribute, raw in vars(value).items():
            if attribute.startswith("_"):
                continue
            member = (raw.__func__ if isinstance(raw, classmethod | staticmethod)
                      else raw.fget if isinstance(raw, property) else raw)
            if inspect.isfunction(member) and not (member.__doc__ or "").strip():
                missing.append(f"{name}.{attribute}")
    return missing


@pytest.mark.parametrize("module_name", PUBLIC)
def test_every_public_name_has_a_docstring(module_name: str) -> None:
    assert _undocumented(module_name) == []


@pytest.mark.parametrize("module_name", PUBLIC)
def test_the_reference_renders_the_module(module_name: str) -> None:
    pages = "\n".join(page.read_text() for page in REFERENCE.glob("*.md"))
    assert f"::: {module_name}\n" in pages


@pytest.mark.parametrize("module_name", sorted(_rendered("mos_lease.md")))
def test_every_name_the_core_reference_renders_has_a_docstring(module_name: str) -> None:
    members = _rendered("mos_lease.md")[module_name]
    module = importlib.import_module(module_name)
    assert [name for name in members or [] if not hasattr(module, name)] == []
    assert _undocumented(module_name, members) == []


def test_the_core_top_level_is_what_a_gateway_author_uses() -> None:
    """About 35 names; a store's contract, records, events and the like are imported from
    their submodules, each of which the reference renders."""
    import mos_lease

    assert len(mos_lease.__all__) <= 40  # with hold()'s two option groups and the supervisors
    rendered = _rendered()
    for module in ("mos_lease.ports", "mos_lease.records", "mos_lease.events",
                   "mos_lease.identity", "mos_lease.fencing", "mos_lease.clock"):
        assert module in rendered, module


# The site itself: its docstrings' reST roles (``:class:`~mos_lease.ports.LeaseStore```) are
# rewritten by the griffe extension ``docs/hooks/sphinx_roles.py`` into cross-references.
ROOT = REFERENCE.parents[1]
_RAW_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|data|const|mod|exc|obj):(?:`|<code>)")


def _extension() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "sphinx_roles", ROOT / "docs" / "hooks" / "sphinx_roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``mkdocs build --strict`` makes it: an unresolved reference fails it."""
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr
    return out


def _page(site: Path, name: str) -> str:
    return (site / "reference" / name / "index.html").read_text()


def test_no_docstring_role_is_shown_raw(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    raw = {str(page.relative_to(site)): _RAW_ROLE.findall(page.read_text()) for page in pages}
    assert {page: roles for page, roles in raw.items() if roles} == {}




@pytest.mark.parametrize(("module_name", "page"), [
    ("mos_lease", "mos_lease"), ("mos_lease_pg", "mos_lease_pg"),
    ("mos_lease_memory", "mos_lease_memory"), ("mos_lease.testing", "testing")])
def test_the_package_introductions_roles_are_links(site: Path, module_name: str,
                                                   page: str) -> None:
    """Each role of a package's docstring (full, ``~``-shortened or relative to the package)
    is a link to the object's entry in the reference."""
    html = _page(site, page)
    doc = importlib.import_module(module_name).__doc__ or ""
    roles = list(_extension().ROLE.finditer(doc))
    assert roles, module_name
    for role in roles:
        written = role["target"]
        shown = re.escape(written.rsplit(".", 1)[-1] if role["short"] else written)
        link = rf'<a class="autorefs autorefs-internal"[^>]* href="[^"]+"><code>{shown}</code></a>'
        assert re.search(link, html), written


def _shingles(text: str, size: int = 6) -> set[tuple[str, ...]]:
    words = re.findall(r"[\w.]+", text.lower())
    return {tuple(words[at:at + size]) for at in range(len(words) - size + 1)}


@pytest.mark.parametrize("name", ["mos_lease", "mos_lease_pg", "mos_lease_memory", "testing"])
def test_a_reference_page_does_not_repeat_its_packages_introduction(site: Path,
                                                                   name: str) -> None:
    """The package's docstring introduces it once; the page's own words only say what the
    page holds."""
    text = (REFERENCE / f"{name}.md").read_text()
    own, block = text.split("\n::: ", 1)
    module = importlib.import_module(block.split()[0])
    assert _shingles(own) & _shingles(module.__doc__ or "") == set()
    summary = (module.__doc__ or "").strip().splitlines()[0].replace("``", "")
    shown = html.unescape(re.sub(r"<[^>]+>", "", _page(site, name)))
    assert shown.count(summary) == 1, summary


def test_a_role_naming_nothing_is_left_for_the_strict_build_to_report() -> None:
    """Resolved relative to the docstring's object; one naming nothing stays a required
    reference, which autorefs reports (and ``--strict`` turns into a failure)."""
    extension = _extension()
    loader = griffe.GriffeLoader(extensions=griffe.load_extensions(extension.SphinxRoles))
    package = loader.load("mos_lease_memory")
    store = package["store.InMemoryLeaseStore"]
    assert ('<autoref identifier="mos_lease.clock.ManualClock">'
            "<code>ManualClock</code></autoref>") in store.docstring.value
    rewritten = extension.rewrite(":meth:`load` and :class:`NoSuchThing`", store, loader)
    assert rewritten == ('<autoref identifier="mos_lease_memory.store.InMemoryLeaseStore.load"'
                         "><code>load</code></autoref> and [`NoSuchThing`][NoSuchThing]")


@pytest.mark.parametrize("name", ["mos_lease.Supervisor.add", "mos_lease.AsyncSupervisor.add",
                                  "mos_lease.ConnectorLeaseCoordinator.live_grants",
                                  "mos_lease.LeaseKeeper.lease"])
def test_a_method_inherited_from_a_private_base_is_documented_under_its_class(
        site: Path, name: str) -> None:
    """The supervisors, coordinators and keepers share members through private bases; the
    reference shows each under the public class (and a role naming it links there)."""
    assert f'id="{name}"' in _page(site, "mos_lease")
