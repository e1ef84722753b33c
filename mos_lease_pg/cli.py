"""``mos-lease migrate | status | audit``: the operator commands for PostgreSQL.

The main ``mos-lease`` command calls :func:`register` to add them; ``python -m
mos_lease_pg`` runs them on their own. ``--dsn`` defaults to the ``MOS_LEASE_DSN``
environment variable, so a password need not appear in the process list. ``--schema``
(default ``$MOS_LEASE_SCHEMA``, else ``mos_lease``) names the schema every command uses: the
connecting role's search_path is never consulted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from mos_lease.errors import ConfigurationError, MosLeaseError
from mos_lease.records import AuditRecord, LeaseRow
from mos_lease_pg.connection import ConnectionSettings
from mos_lease_pg.migrations import applied_versions, available_migrations, migrate
from mos_lease_pg.statements import DEFAULT_SCHEMA, check_schema
from mos_lease_pg.store import MAX_AUDIT_PAGE, PostgresLeaseStore

DSN_ENV = "MOS_LEASE_DSN"
SCHEMA_ENV = "MOS_LEASE_SCHEMA"


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _add_dsn(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get(DSN_ENV)
    parser.add_argument(
        "--dsn", default=default, required=default is None,
        help=f"libpq connection string or postgresql:// URL (default: ${DSN_ENV})")
    parser.add_argument(
        "--schema", type=_schema, default=os.environ.get(SCHEMA_ENV, DEFAULT_SCHEMA),
        help=f"schema of the mos-lease tables (default: ${SCHEMA_ENV}, else {DEFAULT_SCHEMA})")


def _schema(value: str) -> str:
    try:
        return check_schema(value)
    except ConfigurationError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def _store(args: argparse.Namespace) -> PostgresLeaseStore:
    return PostgresLeaseStore(args.dsn, settings=ConnectionSettings(schema=args.schema))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``migrate``, ``status`` and ``audit`` to the ``mos-lease`` command."""
    migrate_parser = subparsers.add_parser(
        "migrate", help="create or upgrade the mos-lease schema (idempotent)",
        description="Apply pending schema migrations. Safe to run from several hosts at "
                    "once; run it as the owner role (see mos_lease_pg/sql/roles.sql). "
                    "Refuses to build the tables when another schema of the database "
                    "already holds them.")
    _add_dsn(migrate_parser)
    migrate_parser.add_argument(
        "--allow-second-copy", action="store_true",
        help="build the tables even though another schema of this database holds them")
    migrate_parser.set_defaults(func=run_migrate)

    status_parser = subparsers.add_parser(
        "status", help="show the current lease of every binding",
        description="List lease rows with their state judged by the database clock.")
    _add_dsn(status_parser)
    status_parser.add_argument("--tenant", help="only this tenant's leases")
    status_parser.add_argument("--json", action="store_true", help="machine-readable output")
    status_parser.set_defaults(func=run_status)

    audit_parser = subparsers.add_parser(
        "audit", help="show the lease audit trail",
        description="List audit records in sequence order, oldest first.")
    _add_dsn(audit_parser)
    audit_parser.add_argument("--tenant", help="only this tenant")
    audit_parser.add_argument("--agent", help="only this logical agent id")
    audit_parser.add_argument("--binding", help="only this binding id")
    audit_parser.add_argument("--after-seq", type=int, default=0,
                              help="only records after this sequence number (for paging)")
    audit_parser.add_argument("--limit", type=int, default=100,
                              help=f"at most this many records (1..{MAX_AUDIT_PAGE})")
    audit_parser.add_argument("--json", action="store_true", help="machine-readable output")
    audit_parser.set_defaults(func=run_audit)


def _fail(error: Exception) -> int:
    print(f"mos-lease: {error}", file=sys.stderr)
    return 1


def run_migrate(args: argparse.Namespace) -> int:
    try:
        applied = migrate(args.dsn, schema=args.schema,
                          allow_second_copy=args.allow_second_copy)
        current = applied_versions(args.dsn, schema=args.schema)
    except MosLeaseError as error:
        return _fail(error)
    known = {m.version for m in available_migrations()}
    if applied:
        print(f"applied migrations: {', '.join(str(v) for v in applied)}")
    else:
        print("schema is up to date")
    print(f"schema {args.schema} version: {max(current, default=0)}")
    newer = sorted(set(current) - known)
    if newer:
        print(f"note: the database has versions this package does not know: {newer}")
    return 0


def _lease_json(row: LeaseRow, now: datetime) -> dict[str, Any]:
    return {
        "tenant_id": row.identity.tenant_id, "logical_agent_id": row.identity.logical_agent_id,
        "binding_id": row.identity.binding_id, "connector_id": row.connector_id,
        "epoch": row.epoch, "state": row.state(now).value, "scopes": list(row.scopes),
        "acquired_at": _iso(row.acquired_at), "heartbeat_at": _iso(row.heartbeat_at),
        "expires_at": _iso(row.expires_at), "released_at": _iso(row.released_at),
        "updated_at": _iso(row.updated_at),
    }


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                     .rstrip() for line in (header, *rows))


def run_status(args: argparse.Namespace) -> int:
    # The lease UUID is deliberately not shown: together with connector and epoch it is
    # what a heartbeat or release matches.
    try:
        with _store(args) as store:
            now = store.now()
            rows = store.leases(args.tenant)
    except MosLeaseError as error:
        return _fail(error)
    if args.json:
        print(json.dumps({"now": _iso(now), "leases": [_lease_json(r, now) for r in rows]},
                         indent=2))
        return 0
    print(f"database time {now.isoformat()}; {len(rows)} lease(s)")
    if rows:
        print(_table(
            ("TENANT", "AGENT", "BINDING", "CONNECTOR", "EPOCH", "STATE", "EXPIRES"),
            [(r.identity.tenant_id, r.identity.logical_agent_id, r.identity.binding_id,
              r.connector_id, str(r.epoch), r.state(now).value, r.expires_at.isoformat())
             for r in rows]))
    return 0


def _audit_json(record: AuditRecord) -> dict[str, Any]:
    entry = record.entry
    return {
        "seq": record.seq, "recorded_at": _iso(record.recorded_at),
        "event_id": str(entry.event_id), "event": entry.event.value,
        "outcome": entry.outcome.value,
        "reason": None if entry.reason is None else entry.reason.value,
        "tenant_id": entry.identity.tenant_id,
        "logical_agent_id": entry.identity.logical_agent_id,
        "binding_id": entry.identity.binding_id, "connector_id": entry.connector_id,
        "epoch": entry.epoch, "correlation_id": entry.correlation_id,
    }


def run_audit(args: argparse.Namespace) -> int:
    try:
        with _store(args) as store:
            records = store.search_audit(
                tenant_id=args.tenant, logical_agent_id=args.agent, binding_id=args.binding,
                after_seq=args.after_seq, limit=args.limit)
    except MosLeaseError as error:
        return _fail(error)
    last = records[-1].seq if records else args.after_seq
    if args.json:
        print(json.dumps({"records": [_audit_json(r) for r in records], "last_seq": last},
                         indent=2))
        return 0
    if not records:
        print("no audit records")
        return 0
    print(_table(
        ("SEQ", "RECORDED", "EVENT", "OUTCOME", "REASON", "IDENTITY", "CONNECTOR", "EPOCH",
         "CORRELATION"),
        [(str(r.seq), r.recorded_at.isoformat(), r.entry.event.value, r.entry.outcome.value,
          "" if r.entry.reason is None else r.entry.reason.value, str(r.entry.identity),
          r.entry.connector_id, "" if r.entry.epoch is None else str(r.entry.epoch),
          r.entry.correlation_id) for r in records]))
    if len(records) == args.limit:
        print(f"(more may follow: --after-seq {last})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mos_lease_pg",
                                     description="mos-lease PostgreSQL operations")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result
