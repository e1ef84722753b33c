"""``mos-lease audit archive | verify | partitions``: audit retention for operators (the
logic is in :mod:`mos_lease_pg.admin.archive`). Without a subcommand ``mos-lease audit`` lists
records (:mod:`mos_lease_pg.admin.cli`). Archive and partitions run as the owner role.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import date
from pathlib import Path

from mos_lease.errors import MosLeaseError
from mos_lease_pg.admin import archive


def _date(value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {value!r}") from None


def _months(value: str) -> int:
    try:
        months = int(value)
    except ValueError:
        months = -1
    if not 0 <= months <= 120:
        raise argparse.ArgumentTypeError(f"months ahead must be 0..120, not {value!r}")
    return months


def register(audit_parser: argparse.ArgumentParser,
             add_dsn: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the retention subcommands under ``audit``; ``add_dsn`` adds --dsn and --schema."""
    commands = audit_parser.add_subparsers(dest="audit_command", metavar="SUBCOMMAND")
    archive_parser = commands.add_parser(
        "archive", help="export, verify, detach and drop audit partitions before a date",
        description="As the owner role: write every audit partition wholly before DATE "
                    "(UTC) to DIR as JSON Lines with a SHA-256 manifest, compare each file "
                    "with the table, then detach and drop the partition. Safe to rerun.")
    add_dsn(archive_parser)
    archive_parser.add_argument("--before", type=_date, required=True, metavar="DATE",
                                help="archive partitions that end on or before this date; "
                                     "at most the first day of the current month")
    archive_parser.add_argument("--to", type=Path, required=True, metavar="DIR",
                                help="directory of the archive (created if missing)")
    archive_parser.set_defaults(func=run_archive)

    verify_parser = commands.add_parser(
        "verify", help="check an archive directory against its manifest",
        description="Check each file of DIR against manifest.json: every line (an audit "
                    "row with an integer seq, in seq order), row count, seq range and "
                    "SHA-256. Each finding names its file and line; every file is checked. "
                    "Exit 0 if all agree, 1 (tampered) otherwise. Needs no database.")
    verify_parser.add_argument("directory", type=Path, metavar="DIR")
    verify_parser.set_defaults(func=run_verify)

    partitions_parser = commands.add_parser(
        "partitions", help="create the audit log's monthly partitions ahead",
        description="As the owner role: create the monthly audit partitions from the "
                    "current month through --ahead months after it, adopting rows the "
                    "DEFAULT partition caught. Idempotent; run it at least monthly.")
    add_dsn(partitions_parser)
    partitions_parser.add_argument("--ahead", type=_months, default=archive.MONTHS_AHEAD,
                                   help=f"months after the current one (default "
                                        f"{archive.MONTHS_AHEAD})")
    partitions_parser.set_defaults(func=run_partitions)


def _fail(error: Exception) -> int:
    print(f"mos-lease: {error}", file=sys.stderr)
    return 1


def run_archive(args: argparse.Namespace) -> int:
    try:
        report = archive.archive(args.dsn, args.schema, args.before, args.to)
    except MosLeaseError as error:
        return _fail(error)
    for entry in report.archived:
        print(f"archived {entry.partition}: {entry.digest.rows} rows to {entry.file} "
              f"(sha256 {entry.digest.sha256}), dropped")
    if not report.archived:
        print(f"no partition ends on or before {args.before.isoformat()}")
    for name in report.kept:
        print(f"kept {name}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    try:
        entries, problems = archive.verify(args.directory)
    except MosLeaseError as error:
        return _fail(error)
    for problem in problems:
        print(f"problem: {problem}")
    print(f"{len(entries)} archived partition(s), {len(problems)} problem(s)")
    return 1 if problems else 0


def run_partitions(args: argparse.Namespace) -> int:
    try:
        made = archive.make_partitions(args.dsn, args.schema, args.ahead)
    except MosLeaseError as error:
        return _fail(error)
    print(f"created {', '.join(made)}" if made else "every partition exists already")
    return 0
