"""What the built distributions must carry: the licence in both, with its SPDX expression
in the metadata; in the sdist the changelog and every file of docs/, specs/ and examples/
(what the README links to), so that those links work outside the repository.

Usage: python .ci/check_dist.py DIST_DIR   (from the project root, after ``python -m build``)
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRIED = ("docs", "specs", "examples")


def _one(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {dist}, found {found}"
    return found[0]


def check_metadata(text: str, where: str) -> None:
    fields = HeaderParser().parsestr(text)
    assert fields["License-Expression"] == "Apache-2.0", where
    assert fields.get_all("License-File") == ["LICENSE"], where
    assert fields["License"] is None, f"{where}: a free-text License field beside the SPDX one"


def check_wheel(wheel: Path, licence: str) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/METADATA"))
        assert archive.read(f"{info}/licenses/LICENSE").decode() == licence, wheel
        check_metadata(archive.read(f"{info}/METADATA").decode(), wheel.name)


def check_sdist(sdist: Path, licence: str) -> None:
    with tarfile.open(sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        names = {name.removeprefix(f"{top}/") for name in archive.getnames()}

        def text(name: str) -> str:
            member = archive.extractfile(f"{top}/{name}")
            assert member is not None, name
            return member.read().decode()

        assert text("LICENSE") == licence, sdist
        assert text("CHANGELOG.md") == (ROOT / "CHANGELOG.md").read_text(), sdist
        check_metadata(text("PKG-INFO"), sdist.name)
    expected = {str(path.relative_to(ROOT)) for folder in CARRIED
                for path in (ROOT / folder).rglob("*")
                if path.is_file() and "__pycache__" not in path.parts}
    assert expected, "nothing found to carry"
    missing = sorted(expected - names)
    assert not missing, f"{sdist.name} lacks {missing[:10]}"


def main(dist_dir: str) -> None:
    dist = Path(dist_dir)
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    check_wheel(_one(dist, "*.whl"), licence)
    check_sdist(_one(dist, "*.tar.gz"), licence)
    print(f"{dist}: the licence in the wheel and the sdist; the sdist carries the changelog "
          f"and {', '.join(CARRIED)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
