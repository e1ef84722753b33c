"""Audit retention: the audit log's monthly partitions (migration 0003), made ahead, and old
ones exported, verified and only then dropped. Rows are never changed or deleted; whole
partitions leave by DDL, as the owner role only.

``archive`` writes each partition wholly before the cutoff to ``DIR/<partition>.jsonl`` (one
JSON object per row, in seq order) and records its row count, seq range and SHA-256 in
``DIR/manifest.json``; it then reads the rows again from the table, compares them with the
file read back from disk, and only if they agree detaches and drops the partition, all in
one transaction that holds the partition against new rows. An entry of the manifest is never
overwritten or shrunk: a partition of that name whose rows differ from it is refused
(:class:`ArchiveConflict`, naming what differs). Each drop records the boundary retention has
passed, and from then on the database refuses any audit row before it (migration 0004), so a
month once archived never receives a row again. ``verify`` checks a directory against its
manifest, without a database: it and the archive's files and manifest are
:mod:`mos_lease_pg.admin.archive_files`, whose public names are exported here too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Final

import attrs
import psycopg
from psycopg import sql

from mos_lease.errors import ConfigurationError
from mos_lease_pg.admin.archive_files import (
    MANIFEST,
    ArchiveError,
    Digest,
    Entry,
    Summing,
    digest_lines,
    file_lines,
    read_manifest,
    scan,
    verify,
    write_durably,
    write_manifest,
)
from mos_lease_pg.sql_files import schema_query

__all__ = ["AUDIT", "MANIFEST", "MONTHS_AHEAD", "ArchiveConflict", "ArchiveError",
           "ArchiveReport", "Digest", "Entry", "NotOwner", "Partition", "archive",
           "make_partitions", "partitions", "read_manifest", "verify"]

AUDIT: Final = "connector_lease_audit_log"
MONTHS_AHEAD: Final = 3
_FETCH: Final = 10_000
_BOUND: Final = re.compile(r"FOR VALUES FROM \((MINVALUE|'[^']*')\) TO \((MAXVALUE|'[^']*')\)")


class ArchiveConflict(ArchiveError):
    """The archive already holds an entry for a partition whose rows now differ from it: an
    entry is never overwritten or shrunk (the message names what differs)."""


class NotOwner(ArchiveError, ConfigurationError):
    """Retention changes the schema: only the owner role of the audit log may run it."""


@attrs.frozen(slots=True)
class Partition:
    """One partition of the audit log; ``low`` None is MINVALUE, ``high`` None MAXVALUE."""

    name: str
    low: datetime | None
    high: datetime | None
    default: bool = False


@attrs.frozen(slots=True)
class ArchiveReport:
    archived: tuple[Entry, ...]
    # Partitions left in place because they reach past the cutoff (not the DEFAULT).
    kept: tuple[str, ...]


def _connect(conninfo: str) -> psycopg.Connection[Any]:
    try:
        # Partition bounds are UTC; a UTC session prints them so.
        return psycopg.Connection.connect(conninfo, autocommit=True, options="-c TimeZone=UTC",
                                          application_name="mos-lease audit")
    except psycopg.Error as exc:
        raise ArchiveError(f"cannot connect to PostgreSQL: {exc}") from exc


def _sql(schema: str, name: str, **marks: str) -> sql.SQL | sql.Composed:
    return schema_query(schema, "audit", name, **marks)


def _require_owner(conn: psycopg.Connection[Any], schema: str) -> None:
    row = conn.execute(_sql(schema, "log_owner.sql"),
                       {"schema": schema, "name": AUDIT}).fetchone()
    if row is None or row[0] != "p":
        raise ArchiveError(f"schema {schema!r} has no partitioned audit log: run "
                           f"`mos-lease migrate --schema {schema}` as the owner role")
    _kind, owner, user = row
    if owner != user:
        raise NotOwner(f"role {user!r} does not own {schema}.{AUDIT}: audit retention runs "
                       f"as the owner role ({owner!r}); nothing was changed")


def _bound(text: str) -> datetime | None:
    if text in ("MINVALUE", "MAXVALUE"):
        return None
    return datetime.fromisoformat(text.strip("'")).astimezone(UTC)


def partitions(conn: psycopg.Connection[Any], schema: str) -> list[Partition]:
    """The audit log's partitions, oldest first, the DEFAULT last."""
    found = []
    for name, bound in conn.execute(_sql(schema, "partitions.sql")):
        if bound == "DEFAULT":
            found.append(Partition(name, None, None, default=True))
            continue
        match = _BOUND.fullmatch(bound)
        if match is None:
            raise ArchiveError(f"partition {name} has a bound this mos-lease does not know: "
                               f"{bound}")
        found.append(Partition(name, _bound(match[1]), _bound(match[2])))
    far = datetime.max.replace(tzinfo=UTC)
    return sorted(found, key=lambda p: (p.default, p.high or far))


def make_partitions(conninfo: str, schema: str, ahead: int = MONTHS_AHEAD) -> list[str]:
    """Create the missing monthly partitions through ``ahead`` months after the current one
    (adopting rows the DEFAULT partition caught); return the names created."""
    if isinstance(ahead, bool) or not isinstance(ahead, int) or not 0 <= ahead <= 120:
        raise ConfigurationError(f"months ahead must be an integer 0..120, not {ahead!r}")
    with _connect(conninfo) as conn:
        _require_owner(conn, schema)
        try:
            return [name for (name,) in conn.execute(_sql(schema, "make_partitions.sql"),
                                                     {"ahead": ahead})]
        except psycopg.Error as exc:
            raise ArchiveError(f"partition maintenance failed: {exc}") from exc


def _table_lines(conn: psycopg.Connection[Any], schema: str, part: str) -> Iterator[bytes]:
    # A server-side cursor: a partition can hold far more rows than fit in memory.
    with conn.cursor(name=f"mos_lease_archive_{part}") as cur:
        cur.itersize = _FETCH
        cur.execute(_sql(schema, "lines.sql", partition=part))
        for (line,) in cur:
            yield line.encode("utf-8")


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _differences(archived: Digest, found: Digest) -> str:
    """What differs between an archive entry and a partition's rows now ('' if nothing)."""
    named = []
    if archived.rows != found.rows:
        named.append(f"{archived.rows} rows archived, {found.rows} in the table")
    if (archived.first_seq, archived.last_seq) != (found.first_seq, found.last_seq):
        named.append(f"seq {archived.first_seq}..{archived.last_seq} archived, "
                     f"{found.first_seq}..{found.last_seq} in the table")
    if archived.sha256 != found.sha256:
        named.append(f"SHA-256 {archived.sha256} archived, {found.sha256} in the table")
    return "; ".join(named)


def _archive_one(conn: psycopg.Connection[Any], schema: str, part: Partition,
                 directory: Path, entries: dict[str, Entry]) -> Entry:
    assert part.high is not None
    target = directory / f"{part.name}.jsonl"
    with conn.transaction():
        conn.execute(_sql(schema, "lock_partition.sql", partition=part.name))
        old = entries.get(part.name)
        if old is None:
            summing = Summing()

            def exported() -> Iterator[bytes]:
                for line in _table_lines(conn, schema, part.name):
                    summing.add(line)
                    yield line + b"\n"

            write_durably(target, exported())
            entry = Entry(part.name, target.name, _iso(part.low), part.high.isoformat(),
                          summing.digest())
            # The entry is on disk before the drop: a crash after the drop keeps it.
            entries[part.name] = entry
            write_manifest(directory, entries)
        else:
            # Archived already (a rerun after a crash between the manifest and the drop): an
            # entry is never rewritten, so the partition must hold exactly what it records.
            differs = _differences(old.digest, digest_lines(_table_lines(conn, schema, part.name)))
            if differs:
                raise ArchiveConflict(
                    f"{directory / MANIFEST} already holds partition {part.name} and the "
                    f"table's rows differ from it ({differs}): an archive entry is never "
                    "overwritten or shrunk; nothing was changed")
            entry = old
            if not target.exists() or scan(target) != (entry.digest, []):
                # The same rows as the entry records, so the same bytes.
                write_durably(target, (line + b"\n"
                                        for line in _table_lines(conn, schema, part.name)))
        # Verify: the table read again against the file read back from disk.
        in_table = digest_lines(_table_lines(conn, schema, part.name))
        on_disk = digest_lines(file_lines(target))
        if not in_table == on_disk == entry.digest:
            raise ArchiveError(f"{target} does not match partition {part.name} (table "
                               f"{in_table}, file {on_disk}): not dropped")
        conn.execute(_sql(schema, "detach.sql", partition=part.name))
        conn.execute(_sql(schema, "drop.sql", partition=part.name))
        # From now on no row may join that month again, by any role.
        conn.execute(_sql(schema, "retained.sql"), {"boundary": part.high})
    return entry


def archive(conninfo: str, schema: str, before: date, directory: Path) -> ArchiveReport:
    """Export, verify, detach and drop every partition wholly before ``before`` (UTC
    midnight). Refused (nothing changed) unless run as the owner role, and for a cutoff
    after the start of the current month or one that rows of the DEFAULT partition precede.
    Safe to run again after a crash: a partition that still exists is exported again (or,
    if the manifest has its entry already, checked against it: :class:`ArchiveConflict`
    if its rows differ, since an entry is never rewritten), and the manifest keeps the
    entries of partitions already dropped. Each drop records the boundary retention has
    passed; no audit row can be appended before it afterwards."""
    if not isinstance(before, date):
        raise ConfigurationError(f"before must be a date, not {before!r}")
    cutoff = datetime(before.year, before.month, before.day, tzinfo=UTC)
    with _connect(conninfo) as conn:
        _require_owner(conn, schema)
        row = conn.execute(_sql(schema, "month_start.sql")).fetchone()
        assert row is not None
        month_start = row[0].astimezone(UTC)
        if cutoff > month_start:
            raise ArchiveError(
                f"--before {before.isoformat()} cuts through the current month (UTC): the "
                f"latest cutoff is {month_start.date().isoformat()}; nothing was changed")
        found = partitions(conn, schema)
        caught = conn.execute(_sql(schema, "default_oldest.sql")).fetchone()
        if caught is not None and caught[0] is not None and caught[0] < cutoff:
            raise ArchiveError(
                f"the DEFAULT audit partition holds rows from {caught[0].isoformat()}, before "
                f"the cutoff: run `mos-lease audit partitions --schema {schema}` first, which "
                "moves them into a partition of their own; nothing was changed")
        directory.mkdir(parents=True, exist_ok=True)
        entries = read_manifest(directory)
        archived = []
        kept = []
        for part in found:
            if part.default:
                continue
            if part.high is None or part.high > cutoff:
                kept.append(part.name)
                continue
            old = entries.get(part.name)
            if old is not None and (old.low, old.high) != (_iso(part.low),
                                                           part.high.isoformat()):
                raise ArchiveError(
                    f"the manifest in {directory} holds another partition named {part.name} "
                    f"({old.low} to {old.high}): archive into another directory")
            try:
                archived.append(_archive_one(conn, schema, part, directory, entries))
            except psycopg.Error as exc:
                raise ArchiveError(f"archiving {part.name} failed, it was not dropped: "
                                   f"{exc}") from exc
        return ArchiveReport(tuple(archived), tuple(kept))
