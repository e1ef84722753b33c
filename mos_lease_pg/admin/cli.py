"""``mos-lease setup | roles | migrate | check | status | audit``: the operator commands for
PostgreSQL.

The main ``mos-lease`` command finds each through its entry point (``add_setup`` ...);
``python -m mos_lease_pg`` runs them on their own. ``--dsn`` defaults to the ``MOS_LEASE_DSN``
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

from mos_lease.cli import AddCommand, Commands
from mos_lease.errors import ConfigurationError, MosLeaseError
from mos_lease.ports import MAX_AUDIT_PAGE
from mos_lease_pg.admin import audit_cli, check, fleet_cli, render, roles
from mos_lease_pg.admin.migrations import applied_versions, migrate
from mos_lease_pg.connection import ConnectionSettings
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, check_schema
from mos_lease_pg.store import PostgresLeaseStore
from mos_lease_pg.versions import available_migrations

DSN_ENV = "MOS_LEASE_DSN"
SCHEMA_ENV = "MOS_LEASE_SCHEMA"


def _add_dsn(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    default = os.environ.get(DSN_ENV)
    parser.add_argument(
        "--dsn", default=default, required=required and default is None,
        help=f"libpq connection string or postgresql:// URL (default: ${DSN_ENV})")
    parser.add_argument(
        "--schema", type=_schema, default=os.environ.get(SCHEMA_ENV, DEFAULT_SCHEMA),
        help=f"schema of the mos-lease tables (default: ${SCHEMA_ENV}, else {DEFAULT_SCHEMA})")


def _add_second_copy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-second-copy", action="store_true",
        help="build the tables even though another schema of this database holds them")


def _schema(value: str) -> str:
    try:
        return check_schema(value)
    except ConfigurationError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def _name(value: str) -> str:
    # Role names go into SQL and into startup options: the same plain form as schemas.
    try:
        return check_schema(value, "role name")
    except ConfigurationError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def _add_layout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--owner-role", type=_name, default=roles.DEFAULT_OWNER_ROLE,
                        help="role that owns the schema and runs migrations "
                             f"(default {roles.DEFAULT_OWNER_ROLE})")
    parser.add_argument("--gateway-role", type=_name, default=roles.DEFAULT_GATEWAY_ROLE,
                        help="least-privilege role gateways connect as "
                             f"(default {roles.DEFAULT_GATEWAY_ROLE})")
    parser.add_argument("--statement-timeout", default=roles.DEFAULT_STATEMENT_TIMEOUT,
                        help="gateway role default statement_timeout "
                             f"(default {roles.DEFAULT_STATEMENT_TIMEOUT})")
    parser.add_argument("--lock-timeout", default=roles.DEFAULT_LOCK_TIMEOUT,
                        help="gateway role default lock_timeout "
                             f"(default {roles.DEFAULT_LOCK_TIMEOUT})")


def _add_effect_tables(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--effect-table", action="append", default=[], metavar="SCHEMA.TABLE",
        dest="effect_tables",
        help="an application table gateways write in fenced effects "
             "(mos_lease_pg.effects.fenced_transaction): grant the gateway role "
             "--effect-privileges on it, USAGE on its schema and on its serial columns' "
             "sequences, in the same transaction; repeat for each table")
    parser.add_argument(
        "--effect-privileges", default=",".join(roles.EFFECT_PRIVILEGES),
        help="privileges granted on each --effect-table, separated by commas (at most "
             f"{','.join(roles.EFFECT_PRIVILEGES)}, the default)")


def _layout(args: argparse.Namespace) -> dict[str, str]:
    return {"owner_role": args.owner_role, "gateway_role": args.gateway_role,
            "schema_name": args.schema, "statement_timeout": args.statement_timeout,
            "lock_timeout": args.lock_timeout}


def _store(args: argparse.Namespace) -> PostgresLeaseStore:
    return PostgresLeaseStore(args.dsn, settings=ConnectionSettings(schema=args.schema))


# Every command this module adds, in the order ``--help`` lists them; each is also an entry
# point of the group ``mos_lease.cli`` (pyproject.toml), which the main command loads.
def add_setup(commands: Commands) -> None:
    """Add ``mos-lease setup``: a new database's roles, migrations and grants in one go."""
    setup_parser = commands.add_parser(
        "setup", help="set up a new database: roles, migrate as the owner, roles (idempotent)",
        description="The whole first-time order, run as a superuser: create the owner and "
                    "gateway roles and the schema, apply the migrations as the owner role "
                    "(SET ROLE, or --owner-dsn), then grant the gateway role its "
                    "privileges on the tables. Running it again changes nothing.")
    _add_dsn(setup_parser)
    _add_layout(setup_parser)
    setup_parser.add_argument("--owner-dsn",
                              help="connect as the owner for the migrations instead of "
                                   "SET ROLE on --dsn")
    _add_second_copy(setup_parser)
    _add_effect_tables(setup_parser)
    setup_parser.set_defaults(func=run_setup)


def add_roles(commands: Commands) -> None:
    """Add ``mos-lease roles``: the role layout applied or printed."""
    roles_parser = commands.add_parser(
        "roles", help="create the roles and schema, grant on the tables that exist",
        description="Apply the least-privilege role layout shipped in the package "
                    "(mos_lease_pg/sql/roles.sql) as a superuser, or print it with --print. "
                    "Idempotent; before the first migrate it can only create the roles and "
                    "the schema, so run it again after migrate (setup does both). With "
                    "--effect-table it also lets the gateway role write the application's "
                    "tables that fenced effects write.")
    _add_dsn(roles_parser, required=False)
    _add_layout(roles_parser)
    _add_effect_tables(roles_parser)
    roles_parser.add_argument("--print", action="store_true",
                              help="print the script with these values instead of running it "
                                   "(for psql -f - or review)")
    roles_parser.set_defaults(func=run_roles)


def add_migrate(commands: Commands) -> None:
    """Add ``mos-lease migrate``: the schema created or upgraded."""
    migrate_parser = commands.add_parser(
        "migrate", help="create or upgrade the mos-lease schema (idempotent)",
        description="Apply pending schema migrations. Safe to run from several hosts at "
                    "once; run it as the owner role (see `mos-lease roles`), then run "
                    "`mos-lease roles` again when it applied any. "
                    "Refuses to build the tables when another schema of the database "
                    "already holds them.")
    _add_dsn(migrate_parser)
    _add_second_copy(migrate_parser)
    migrate_parser.set_defaults(func=run_migrate)


def add_check(commands: Commands) -> None:
    """Add ``mos-lease check``: the database and the connecting role checked for gateway use."""
    check_parser = commands.add_parser(
        "check", help="check the database and the connecting role for gateway use",
        description="Report the server version, the schema and its version, the role's "
                    "privileges, durability settings, whether the server is a standby, the "
                    "clock offset to this host and signs of a pooler (a problem when one "
                    "shares server sessions, unless --behind-pooler). Exit 0 with no "
                    "problem, 1 with a problem, 2 when it cannot connect. Connect as the "
                    "role the gateways use.")
    _add_dsn(check_parser)
    check_parser.add_argument("--json", action="store_true", help="one JSON object")
    check_parser.add_argument(
        "--behind-pooler", action="store_true",
        help="gateways reach the server through a transaction pooler and build their "
             "stores with ConnectionSettings(session_options=False, prepare=False): a "
             "pooler is then a warning naming those settings, not a problem, and role "
             "default timeouts are required")
    check_parser.set_defaults(func=run_check)


def add_status(commands: Commands) -> None:
    """Add ``mos-lease status``: the current lease of every binding."""
    status_parser = commands.add_parser(
        "status", help="show the current lease of every binding, or a fleet",
        description="List lease rows with their state judged by the database clock. With "
                    "--fleet NAME: that fleet's members (endpoint, epoch, expiry), each "
                    "member's share (the bindings whose active lease its connector holds) "
                    "and the bindings last held by a member that no one holds now, the "
                    "oldest first, from one read. Exit 1 if no member of the fleet ever "
                    "held its member lease.")
    _add_dsn(status_parser)
    status_parser.add_argument("--tenant", help="only this tenant's leases (with --fleet: "
                                                "only this tenant's bindings)")
    fleet_cli.register(status_parser)
    status_parser.add_argument("--json", action="store_true", help="machine-readable output")
    status_parser.set_defaults(func=run_status)


def add_audit(commands: Commands) -> None:
    """Add ``mos-lease audit``: the audit trail and its retention subcommands."""
    audit_parser = commands.add_parser(
        "audit", help="show the lease audit trail",
        description="List audit records in sequence order, oldest first.")
    _add_dsn(audit_parser, required=False)  # the retention subcommands take their own
    audit_parser.add_argument("--tenant", help="only this tenant")
    audit_parser.add_argument("--agent", help="only this logical agent id")
    audit_parser.add_argument("--binding", help="only this binding id")
    audit_parser.add_argument("--after-seq", type=int, default=0,
                              help="only records after this sequence number (for paging)")
    audit_parser.add_argument("--limit", type=int, default=100,
                              help=f"at most this many records (1..{MAX_AUDIT_PAGE})")
    audit_parser.add_argument("--json", action="store_true", help="machine-readable output")
    audit_parser.set_defaults(func=run_audit)
    audit_cli.register(audit_parser, _add_dsn)


COMMANDS: dict[str, AddCommand] = {
    "setup": add_setup, "roles": add_roles, "migrate": add_migrate, "check": add_check,
    "status": add_status, "audit": add_audit}


def register(commands: Commands) -> None:
    """Add every command of :data:`COMMANDS` (``python -m mos_lease_pg``)."""
    for add in COMMANDS.values():
        add(commands)


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
        print(f"next: as a superuser, `mos-lease roles --schema {args.schema}` so the gateway "
              "role may use the tables")
    else:
        print("schema is up to date")
    print(f"schema {args.schema} version: {max(current, default=0)}")
    newer = sorted(set(current) - known)
    if newer:
        print(f"note: the database has versions this package does not know: {newer}")
    return 0


def run_roles(args: argparse.Namespace) -> int:
    try:
        if args.print:
            print(roles.role_script(**_layout(args)), end="")
            print(roles.effect_table_script(
                args.effect_tables, gateway_role=args.gateway_role, schema_name=args.schema,
                privileges=args.effect_privileges), end="")
            return 0
        if args.dsn is None:
            raise ConfigurationError(f"--dsn (or ${DSN_ENV}) is required unless --print")
        notices = roles.run_roles(args.dsn, effect_tables=args.effect_tables,
                                  privileges=args.effect_privileges, **_layout(args))
    except MosLeaseError as error:
        return _fail(error)
    for notice in notices:
        print(notice)
    print(f"roles: {args.owner_role} owns schema {args.schema}; {args.gateway_role} holds "
          "its privileges on the tables that exist")
    if args.effect_tables:
        print(f"roles: {args.gateway_role} may "
              f"{', '.join(roles.effect_privileges(args.effect_privileges))} on effect "
              f"tables {', '.join(args.effect_tables)}")
    return 0


def run_setup(args: argparse.Namespace) -> int:
    try:
        report = roles.set_up(
            args.dsn, owner_role=args.owner_role, gateway_role=args.gateway_role,
            schema=args.schema, statement_timeout=args.statement_timeout,
            lock_timeout=args.lock_timeout, owner_conninfo=args.owner_dsn,
            allow_second_copy=args.allow_second_copy, effect_tables=args.effect_tables,
            privileges=args.effect_privileges)
    except MosLeaseError as error:
        return _fail(error)
    for step in report.steps:
        print(step)
    print(f"schema {args.schema} version: {report.version}")
    print(f"gateways connect as {args.gateway_role}; `mos-lease check` as that role "
          "verifies it")
    return 0


def run_check(args: argparse.Namespace) -> int:
    report, code = check.run_check(args.dsn, args.schema, behind_pooler=args.behind_pooler)
    if args.json:
        print(json.dumps({**report.as_json(), "exit_code": code, "schema": args.schema},
                         indent=2))
    else:
        print(check.render_text(report))
    return code


def run_status(args: argparse.Namespace) -> int:
    # The lease UUID is deliberately not shown: together with connector and epoch it is
    # what a heartbeat or release matches.
    if args.fleet is not None:
        return fleet_cli.run(args, lambda: _store(args))
    try:
        with _store(args) as store:
            now = store.now()
            rows = store.leases(args.tenant)
    except MosLeaseError as error:
        return _fail(error)
    if args.json:
        leases = [render.lease_json(r, now) for r in rows]
        print(json.dumps({"now": render.iso(now), "leases": leases}, indent=2))
        return 0
    print(f"database time {now.isoformat()}; {len(rows)} lease(s)")
    if rows:
        print(render.table(
            ("TENANT", "AGENT", "BINDING", "CONNECTOR", "EPOCH", "STATE", "EXPIRES",
             "METADATA"),
            [(r.identity.tenant_id, r.identity.logical_agent_id, r.identity.binding_id,
              r.connector_id, str(r.epoch), r.state(now).value, r.expires_at.isoformat(),
              render.metadata_text(r))
             for r in rows]))
    return 0


def run_audit(args: argparse.Namespace) -> int:
    try:
        if args.dsn is None:
            raise ConfigurationError(f"--dsn (or ${DSN_ENV}) is required")
        with _store(args) as store:
            records = store.search_audit(
                tenant_id=args.tenant, logical_agent_id=args.agent, binding_id=args.binding,
                after_seq=args.after_seq, limit=args.limit)
    except MosLeaseError as error:
        return _fail(error)
    last = records[-1].seq if records else args.after_seq
    if args.json:
        print(json.dumps({"records": [render.audit_json(r) for r in records], "last_seq": last},
                         indent=2))
        return 0
    if not records:
        print("no audit records")
        return 0
    print(render.table(
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
