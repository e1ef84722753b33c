"""``mos-lease audit verify`` without a database: a line that is valid JSON but no audit row
(a list, a string, an object without an integer seq) is a finding with its file and line
number, never a crash, and every other line and file is still checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mos_lease_pg.admin import archive as retention
from mos_lease_pg.admin import archive_files
from tests.pg_fixtures import run_cli as run


def _archived(directory: Path, name: str, first_seq: int, rows: int) -> retention.Entry:
    lines = [json.dumps({"seq": seq, "event": "heartbeat"}).encode()
             for seq in range(first_seq, first_seq + rows)]
    (directory / f"{name}.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    return retention.Entry(name, f"{name}.jsonl", None, "2026-01-01T00:00:00+00:00",
                           archive_files.digest_lines(lines))


def _replace_line(path: Path, number: int, text: bytes) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    lines[number - 1] = text + b"\n"
    path.write_bytes(b"".join(lines))


def test_every_line_that_is_no_audit_row_is_named_and_the_other_files_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entries = {name: _archived(tmp_path, name, first, 6)
               for name, first in (("p_a", 1), ("p_b", 7), ("p_c", 13))}
    archive_files.write_manifest(tmp_path, entries)
    assert run("audit", "verify", str(tmp_path)) == 0
    capsys.readouterr()
    _replace_line(tmp_path / "p_a.jsonl", 2, b"[1]")
    _replace_line(tmp_path / "p_a.jsonl", 4, b'{"event": "heartbeat"}')
    _replace_line(tmp_path / "p_b.jsonl", 1, b'"seq"')
    _replace_line(tmp_path / "p_b.jsonl", 3, b'{"seq": true}')
    _replace_line(tmp_path / "p_b.jsonl", 5, b"not json")
    # p_c is left alone; a changed row in it is found all the same.
    _replace_line(tmp_path / "p_c.jsonl", 6, b'{"seq": 18, "event": "release"}')

    assert run("audit", "verify", str(tmp_path)) == 1
    out = capsys.readouterr().out
    for finding in ("p_a.jsonl: line 2: a JSON list", "p_a.jsonl: line 4: no integer seq",
                    "p_b.jsonl: line 1: a JSON str", "p_b.jsonl: line 3: no integer seq",
                    "p_b.jsonl: line 5: not JSON", "p_c.jsonl: SHA-256"):
        assert finding in out, out
    assert "3 archived partition(s)" in out
    _entries, problems = retention.verify(tmp_path)
    assert sum("SHA-256" in problem for problem in problems) == 3
