"""Scenario 20: a retention adversary -> 0 archived rows lost, every tampering attempt
refused or reported by ``audit verify``.

The least-privilege layout (``roles.sql``) in a schema of its own, with rows planted in
past months (three and two months ago, each its own partition). Connected as the gateway
role, an adversary thread keeps trying to put rows where retention works: stamped in an
archived month, in a past month not yet archived, far in the past, ahead of the clock, in a
month with no partition (the DEFAULT), with ``-infinity``, through a plain ``INSERT`` and
through the resendable record function, and under an event id already applied. Meanwhile
the owner runs the routine steps: ``audit archive`` of the oldest month, ``audit
partitions`` (which adopts whatever the DEFAULT caught), ``audit archive`` of the next month
into the same directory, both once more. Afterwards every archived row must still be in the
archive, ``audit verify`` must pass, and a copy of the archive with forged lines (a line
that is valid JSON but no audit row, a row without seq, a changed row) must be reported by
``verify`` line by line, exit 1, without a crash.

On the code before migration 0004 and the archive's no-overwrite rule the same file shows
the hole: appended rows into archived months succeed, ``partitions`` adopts them, the next
archive overwrites the month's file and the archived rows are gone (RESULTS.md).
"""

from __future__ import annotations

import io
import json
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import redirect_stdout
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease.cli import main as cli
from mos_lease.errors import MosLeaseError
from mos_lease_pg.admin import archive as retention
from tests.faults.support import Table
from tests.pg.test_pg_audit_partitions import _insert_old_rows
from tests.pg.test_pg_roles import Layout, role_layout

pytestmark = [pytest.mark.faults, pytest.mark.pg]

AUDIT = "connector_lease_audit_log"
PLANTED = {3: 25, 2: 30}  # months ago -> rows


def _month(offset: int) -> datetime:
    now = datetime.now(UTC)
    month = now.year * 12 + now.month - 1 + offset
    return datetime(month // 12, month % 12 + 1, 1, tzinfo=UTC)


# Where the adversary stamps its rows (SQL over the row's own statement).
STAMPS = {
    "archived month (3 ago)": f"'{_month(-3).isoformat()}'::timestamptz + interval '1 hour'",
    "past month (2 ago)": f"'{_month(-2).isoformat()}'::timestamptz + interval '2 hours'",
    "far past (2 years)": "clock_timestamp() - interval '2 years'",
    "one second back": "clock_timestamp() - interval '1 second'",
    "ahead of the clock": "clock_timestamp() + interval '10 minutes'",
    "DEFAULT month (+8)": f"'{_month(8).isoformat()}'::timestamptz + interval '1 hour'",
    "-infinity": "'-infinity'::timestamptz",
}
COLUMNS = ("event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id, "
           "connector_id, epoch, correlation_id, recorded_at")


@pytest.fixture
def layout(pg_dsn: str, admin: psycopg.Connection[Any]) -> Iterator[Layout]:
    with role_layout(pg_dsn, admin) as built:
        yield built


def _attempts(layout: Layout, applied: uuid.UUID) -> list[tuple[str, str]]:
    """Every kind of attempt once, as the gateway role: (what, sqlstate or SUCCEEDED)."""
    schema = sql.Identifier(layout.schema)
    log = sql.Literal(f'"{layout.schema}".{AUDIT}')
    out = []
    with psycopg.connect(layout.gateway_dsn, autocommit=True) as conn:
        for where, stamp in STAMPS.items():
            tries = {
                f"INSERT stamped {where}": sql.SQL(
                    "INSERT INTO {}.{} (" + COLUMNS + ") VALUES (gen_random_uuid(), "
                    "'acquire', 'denied', 'lease_held', 'adversary', 'a', 'b', 'c', 1, "
                    "'forged', " + stamp + ")").format(schema, sql.Identifier(AUDIT)),
                f"record stamped {where}": sql.SQL(
                    "SELECT {}.mos_lease_record_audit({}, gen_random_uuid(), 'acquire', "
                    "'denied', 'lease_held', 'adversary', 'a', 'b', 'c', NULL, 'forged', "
                    + stamp + ")").format(schema, log),
            }
            for what, statement in tries.items():
                out.append((what, _outcome(conn, statement)))
        out.append(("INSERT under an applied event id", _outcome(conn, sql.SQL(
            "INSERT INTO {}.{} (" + COLUMNS + ") VALUES ({}, 'acquire', 'denied', "
            "'lease_held', 'adversary', 'a', 'b', 'c', 1, 'forged', clock_timestamp())")
            .format(schema, sql.Identifier(AUDIT), sql.Literal(applied)))))
        out.append(("record with the old time offset", _outcome(conn, sql.SQL(
            "SELECT {}.mos_lease_record_audit({}, gen_random_uuid(), 'acquire', 'denied', "
            "'lease_held', 'adversary', 'a', 'b', 'c', NULL, 'forged', -interval '90 days')")
            .format(schema, log))))
    return out


def _outcome(conn: psycopg.Connection[Any], statement: sql.Composed) -> str:
    try:
        conn.execute(statement)
    except psycopg.Error as exc:
        return f"refused {exc.sqlstate}"
    return "SUCCEEDED"


def _archive(layout: Layout, before: date, directory: Path) -> str:
    try:
        report = retention.archive(layout.owner_dsn, layout.schema, before, directory)
    except MosLeaseError as exc:
        return f"refused: {str(exc)[:160]}"
    except Exception as exc:  # a crash is a finding of its own
        return f"CRASHED: {type(exc).__name__}: {str(exc)[:120]}"
    return f"archived {[(e.partition, e.digest.rows) for e in report.archived]}"


def _partitions(layout: Layout) -> str:
    try:
        return f"made {retention.make_partitions(layout.owner_dsn, layout.schema, 3)}"
    except MosLeaseError as exc:
        return f"refused: {str(exc)[:160]}"
    except Exception as exc:  # as in _archive
        return f"CRASHED: {type(exc).__name__}: {str(exc)[:120]}"


def _verify(directory: Path) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        try:
            code = cli(["audit", "verify", str(directory)])
        except Exception as crash:  # a crash is a finding of its own
            return -1, f"{type(crash).__name__}: {crash}"
    return code, out.getvalue()


def _archived_rows(directory: Path) -> dict[str, int]:
    """Planted rows found in the archive, by tenant (read straight from the files)."""
    found: dict[str, int] = {}
    for path in directory.glob("*.jsonl"):
        for line in path.read_text("utf-8").splitlines():
            row = json.loads(line)
            if isinstance(row, dict):
                found[str(row.get("tenant_id"))] = found.get(str(row.get("tenant_id")), 0) + 1
    return found


def _forged_copy_verified(directory: Path, forged: Path) -> tuple[int, str]:
    """Forged lines in a copy of the archive (a JSON list, a row without seq, a changed
    row): ``verify``'s exit code and report, which must name each."""
    shutil.copytree(directory, forged) if directory.exists() else forged.mkdir()
    files = sorted(forged.glob("*.jsonl"))
    for path, line in zip(files, (b"[1]\n", b'{"event": "heartbeat"}\n'), strict=False):
        path.write_bytes(path.read_bytes() + line)
    if files:
        text = files[-1].read_bytes().replace(b'"m2"', b'"mX"', 1)
        files[-1].write_bytes(text)
    return _verify(forged)


def _routine(layout: Layout, directory: Path, rounds: int) -> list[tuple[str, str]]:
    """The owner's retention steps, run while the adversary works: (step, result)."""
    steps = []
    for k in range(rounds):
        if k == 0:
            steps.append(("archive before month -2", _archive(
                layout, _month(-2).date(), directory)))
        steps.append(("partitions", _partitions(layout)))
        if k == rounds // 2:
            steps.append(("archive before this month", _archive(
                layout, _month(0).date(), directory)))
        time.sleep(0.05)
    steps.append(("archive before this month, again", _archive(
        layout, _month(0).date(), directory)))
    return steps


def _plant(dsn: str, layout: Layout) -> uuid.UUID:
    """The past months' rows (as a superuser, triggers off); returns an applied event id."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for months, count in PLANTED.items():
            _insert_old_rows(conn, layout.schema, months, count, tenant=f"m{months}")
        applied = conn.execute(sql.SQL("SELECT event_id FROM {}.{} ORDER BY seq LIMIT 1")
                               .format(sql.Identifier(layout.schema),
                                       sql.Identifier(AUDIT))).fetchone()
    assert applied is not None
    event_id: uuid.UUID = applied[0]
    return event_id


def test_retention_adversary(layout: Layout, pg_dsn: str, tmp_path: Path, soak: bool,
                             figures: Table) -> None:
    rounds = 40 if soak else 8
    applied = _plant(pg_dsn, layout)
    steps = [("partitions", _partitions(layout))]
    directory = tmp_path / "archive"

    stop = threading.Event()
    results: list[tuple[str, str]] = []

    def adversary() -> None:
        while not stop.is_set():
            results.extend(_attempts(layout, applied))

    worker = threading.Thread(target=adversary, daemon=True)
    worker.start()
    try:
        steps += _routine(layout, directory, rounds)
    finally:
        stop.set()
        worker.join(timeout=60)
    steps.append(("partitions, last", _partitions(layout)))

    succeeded = [what for what, outcome in results if outcome == "SUCCEEDED"]
    archived = _archived_rows(directory)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        counted = conn.execute(sql.SQL("SELECT tenant_id, count(*) FROM {}.{} GROUP BY 1")
                               .format(sql.Identifier(layout.schema), sql.Identifier(AUDIT)))
        kept: dict[str, int] = dict(counted.fetchall())
    # A planted row is lost when it is neither in the archive nor still in the table.
    lost = sum(max(0, count - archived.get(f"m{months}", 0) - kept.get(f"m{months}", 0))
               for months, count in PLANTED.items())
    unarchived = sum(kept.get(f"m{months}", 0) for months in PLANTED)
    foreign = sum(v for k, v in archived.items() if k not in {f"m{m}" for m in PLANTED})
    code, report = _verify(directory)

    forged_code, forged_report = _forged_copy_verified(directory, tmp_path / "forged")
    findings = forged_report.count("problem: ")

    figures.add("tampering attempts as the gateway role", len(results))
    figures.add("attempts that succeeded", len(succeeded), "0", not succeeded)
    crashed = [name for name, result in steps if result.startswith("CRASHED")]
    figures.add("routine steps run (archive, partitions)", len(steps))
    figures.add("routine steps that crashed", len(crashed), "0", not crashed)
    figures.add("planted rows lost (in neither the archive nor the table)", lost, "0",
                lost == 0)
    figures.add("planted rows retention left in the table", unarchived, "0",
                unarchived == 0)
    figures.add("rows in the archive that were never planted", foreign, "0", foreign == 0)
    figures.add("audit verify of the archive", f"exit {code}", "exit 0", code == 0)
    figures.add("verify of the forged copy", f"exit {forged_code}, {findings} findings",
                "exit 1, each forged line named", forged_code == 1 and findings >= 3)
    kinds = sorted({f"{what}: {outcome}" for what, outcome in results})
    figures.notes += [f"{name} -> {result}" for name, result in steps]
    figures.notes += kinds
    print(f"\nscenario 20: {len(results)} attempts, {len(succeeded)} succeeded, {lost} "
          f"archived rows lost, verify exit {code}, forged copy exit {forged_code}")
    assert not succeeded, sorted(set(succeeded))
    assert not crashed, steps
    assert lost == 0 and foreign == 0 and unarchived == 0, (archived, kept, steps)
    assert code == 0, report
    assert forged_code == 1 and findings >= 3, forged_report
