"""``mos-lease audit archive | verify | partitions``: whole old partitions leave as verified
JSON Lines files, never unverified; the cutoff may not cut the current month or rows of the
DEFAULT partition; a rerun after a crash finishes the job and keeps what was dropped; a
changed, cut, missing or extra line is found by ``verify``; the gateway role changes
nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease_pg.admin import archive as retention
from mos_lease_pg.admin import archive_files
from tests.pg.test_pg_audit_partitions import AUDIT, _insert_old_rows, _partitions, _rows
from tests.pg.test_pg_roles import Layout, role_layout
from tests.pg_fixtures import PgSchema
from tests.pg_fixtures import run_cli as run

pytestmark = pytest.mark.pg


def _this_month() -> date:
    now = datetime.now(UTC)
    return date(now.year, now.month, 1)


@pytest.fixture
def aged(pg_migrated_schema_dsn: PgSchema) -> Iterator[PgSchema]:
    """A migrated schema with rows in two past months (each its own partition) and this
    month's rows from a few writes."""
    target = pg_migrated_schema_dsn
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        for months_ago, count in ((3, 25), (2, 30)):
            _insert_old_rows(conn, target.schema, months_ago, count, tenant=f"m{months_ago}")
            retention.make_partitions(target.dsn, target.schema, 3)  # adopts them
        _insert_old_rows(conn, target.schema, 0, 5, tenant="now")
    yield target


def _old(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [row for row in rows if row[5] in ("m3", "m2")]


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines()]


def test_archive_exports_verifies_and_drops_whole_old_partitions(
        aged: PgSchema, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _rows(aged.dsn, aged.schema)
    names = _partitions(aged.dsn, aged.schema)
    assert run("audit", "archive", "--dsn", aged.dsn, "--schema", aged.schema,
               "--before", _this_month().isoformat(), "--to", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.count("archived ") == 2, out
    after = _rows(aged.dsn, aged.schema)
    assert after == [row for row in before if row not in _old(before)]
    gone = sorted(set(names) - set(_partitions(aged.dsn, aged.schema)))
    assert len(gone) == 2
    exported = [line for name in gone for line in _lines(tmp_path / f"{name}.jsonl")]
    assert [(r["seq"], str(r["event_id"]), r["tenant_id"]) for r in exported] == [
        (row[0], str(row[1]), row[5]) for row in _old(before)]
    manifest = json.loads((tmp_path / retention.MANIFEST).read_text("utf-8"))
    assert [(e["partition"], e["rows"]) for e in manifest["partitions"]] == [
        (gone[0], 25), (gone[1], 30)]
    assert run("audit", "verify", str(tmp_path)) == 0
    assert "2 archived partition(s), 0 problem(s)" in capsys.readouterr().out
    # Nothing is older now: a second run archives nothing and keeps the manifest.
    assert run("audit", "archive", "--dsn", aged.dsn, "--schema", aged.schema,
               "--before", _this_month().isoformat(), "--to", str(tmp_path)) == 0
    assert len(retention.read_manifest(tmp_path)) == 2


@pytest.mark.parametrize("tamper", ["changed", "truncated", "missing line", "extra line",
                                    "no newline", "missing file", "extra file"])
def test_verify_finds_every_kind_of_tampering(aged: PgSchema, tmp_path: Path,
                                              tamper: str) -> None:
    report = retention.archive(aged.dsn, aged.schema, _this_month(), tmp_path)
    path = tmp_path / report.archived[0].file
    lines = path.read_bytes().splitlines(keepends=True)
    if tamper == "changed":
        lines[3] = lines[3].replace(b'"renewed"', b'"released"')
    elif tamper == "truncated":
        lines = lines[:-1]
    elif tamper == "missing line":
        del lines[5]
    elif tamper == "extra line":
        lines.append(lines[-1].replace(b'"seq" : ', b'"seq" : 9'))
    elif tamper == "no newline":
        lines[-1] = lines[-1][:-1]
    if tamper == "missing file":
        path.unlink()
    elif tamper == "extra file":
        (tmp_path / "stray.jsonl").write_bytes(lines[0])
    else:
        path.write_bytes(b"".join(lines))
    assert retention.verify(tmp_path)[1] != []
    assert run("audit", "verify", str(tmp_path)) == 1


def test_the_cutoff_may_not_cut_this_month_or_the_default(aged: PgSchema,
                                                          tmp_path: Path) -> None:
    before = _rows(aged.dsn, aged.schema)
    names = _partitions(aged.dsn, aged.schema)
    tomorrow_month = date.fromordinal(_this_month().toordinal() + 1)
    with pytest.raises(retention.ArchiveError, match="cuts through the current month"):
        retention.archive(aged.dsn, aged.schema, tomorrow_month, tmp_path / "a")
    # Rows the DEFAULT caught before the cutoff: adopt them first.
    with psycopg.connect(aged.dsn, autocommit=True) as conn:
        _insert_old_rows(conn, aged.schema, 5, 2, tenant="m5")
    with pytest.raises(retention.ArchiveError, match="DEFAULT"):
        retention.archive(aged.dsn, aged.schema, _this_month(), tmp_path / "b")
    assert _partitions(aged.dsn, aged.schema) == names
    assert _old(_rows(aged.dsn, aged.schema)) == _old(before)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_file_that_does_not_verify_is_never_dropped(
        aged: PgSchema, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _rows(aged.dsn, aged.schema)
    names = _partitions(aged.dsn, aged.schema)
    real = archive_files.file_lines

    def damaged(path: Path) -> Iterator[bytes]:
        for number, line in enumerate(real(path)):
            yield line + b" " if number == 7 else line  # the disk gave back other bytes

    monkeypatch.setattr(retention, "file_lines", damaged)
    with pytest.raises(retention.ArchiveError, match="does not match"):
        retention.archive(aged.dsn, aged.schema, _this_month(), tmp_path)
    assert _partitions(aged.dsn, aged.schema) == names
    assert _rows(aged.dsn, aged.schema) == before
    # A rerun (the disk healthy again) redoes that partition and finishes.
    monkeypatch.setattr(retention, "file_lines", real)
    report = retention.archive(aged.dsn, aged.schema, _this_month(), tmp_path)
    assert len(report.archived) == 2
    assert retention.verify(tmp_path)[1] == []


def test_a_rerun_after_a_crash_keeps_the_entries_of_dropped_partitions(
        aged: PgSchema, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = retention._archive_one
    calls: list[str] = []
    names = _partitions(aged.dsn, aged.schema)

    def crash_on_second(conn: psycopg.Connection[Any], schema: str,
                        part: retention.Partition, directory: Path,
                        entries: dict[str, retention.Entry]) -> retention.Entry:
        calls.append(part.name)
        if len(calls) == 2:
            # The file is written, then the process dies before the drop commits.
            (directory / f"{part.name}.jsonl").write_bytes(b'{"seq" : 1}\n')
            raise KeyboardInterrupt
        return real(conn, schema, part, directory, entries)

    monkeypatch.setattr(retention, "_archive_one", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        retention.archive(aged.dsn, aged.schema, _this_month(), tmp_path)
    assert len(retention.read_manifest(tmp_path)) == 1
    # The first partition was dropped; the second, whose drop never committed, is still there.
    assert _partitions(aged.dsn, aged.schema) == [n for n in names if n != calls[0]]
    monkeypatch.setattr(retention, "_archive_one", real)
    report = retention.archive(aged.dsn, aged.schema, _this_month(), tmp_path)
    assert [e.partition for e in report.archived] == [calls[1]]
    assert sorted(retention.read_manifest(tmp_path)) == sorted(calls)
    assert retention.verify(tmp_path)[1] == []


@pytest.fixture(scope="module")
def layout(pg_dsn: str) -> Iterator[Layout]:
    with psycopg.connect(pg_dsn, autocommit=True) as admin, role_layout(pg_dsn, admin) as built:
        yield built


def test_the_gateway_role_may_not_archive(layout: Layout, tmp_path: Path, pg_dsn: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        _insert_old_rows(conn, layout.schema, 2, 4)
    assert retention.make_partitions(layout.owner_dsn, layout.schema, 3) != []
    names = _partitions(layout.owner_dsn, layout.schema)
    before = _rows(layout.owner_dsn, layout.schema)
    target = tmp_path / "archive"
    assert run("audit", "archive", "--dsn", layout.gateway_dsn, "--schema", layout.schema,
               "--before", _this_month().isoformat(), "--to", str(target)) == 1
    assert "owner role" in capsys.readouterr().err
    assert run("audit", "partitions", "--dsn", layout.gateway_dsn, "--schema",
               layout.schema) == 1
    assert _partitions(layout.owner_dsn, layout.schema) == names
    assert _rows(layout.owner_dsn, layout.schema) == before
    assert not target.exists()
    # The owner may, and the gateway keeps working on what is left.
    assert run("audit", "archive", "--dsn", layout.owner_dsn, "--schema", layout.schema,
               "--before", _this_month().isoformat(), "--to", str(target)) == 0
    with psycopg.connect(layout.gateway_dsn, autocommit=True) as conn:
        left = conn.execute(sql.SQL("SELECT count(*) FROM {}.{}").format(
            sql.Identifier(layout.schema), sql.Identifier(AUDIT))).fetchone()
    assert left == (len(before) - 4,)


def test_bad_input_to_the_commands_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (("audit", "archive", "--dsn", "x", "--before", "2026-13-01", "--to", "d"),
                 ("audit", "archive", "--dsn", "x", "--before", "yesterday", "--to", "d"),
                 ("audit", "partitions", "--dsn", "x", "--ahead", "-1"),
                 ("audit", "partitions", "--dsn", "x", "--ahead", "1000")):
        with pytest.raises(SystemExit) as exit_info:
            run(*argv)
        assert exit_info.value.code == 2, argv
    assert run("audit", "verify", str(tmp_path)) == 1
    assert "no manifest.json" in capsys.readouterr().out
    with pytest.raises(Exception, match="months ahead"):
        retention.make_partitions("host=127.0.0.1 port=1", "mos_lease", -1)
