"""The least-privilege role layout (``sql/roles.sql``), for callers that are not psql, and
the whole first-time order for a new database (:func:`set_up`).

``roles.sql`` is written for ``psql -v name=value -f roles.sql``. :func:`role_script`
renders the same file for a driver: psql meta-commands are dropped and the ``:'name'``
variables become SQL literals, so there is one layout, not two. The file is read from the
installed package, so a wheel install needs no source tree.

The script grants on the tables that exist, and before the first migrate none do: the
working order for a new database is the script, ``migrate`` as the owner role, the script
again. :func:`set_up` runs exactly that; running it again changes nothing.

Fenced effects (``mos_lease_pg.effects.fenced_transaction``) write the application's own
tables as the gateway role: :func:`effect_table_grants` grants it those tables
(``mos-lease roles --effect-table app.outbox``), in the same transaction as the script.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

import attrs
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from mos_lease.errors import ConfigurationError, MosLeaseError
from mos_lease_pg.admin.migrations import applied_versions, migrate
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, check_schema, query_text, sql_text

DEFAULT_OWNER_ROLE: Final = "mos_lease_owner"
DEFAULT_GATEWAY_ROLE: Final = "mos_lease_gateway"
DEFAULT_STATEMENT_TIMEOUT: Final = "5s"
DEFAULT_LOCK_TIMEOUT: Final = "2s"

EFFECT_PRIVILEGES: Final = ("SELECT", "INSERT", "UPDATE", "DELETE")
"""What the gateway role may be granted on an effect table, and the default: all four.
Never TRUNCATE, REFERENCES or TRIGGER."""

_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_DURATION = re.compile(r"[0-9]+\s*(ms|s|min|h)?")
_VARIABLE = re.compile(r":'([a-z_]+)'")


class RoleSetupError(MosLeaseError):
    """The role step could not be applied (connection, privilege or server error). The
    script runs as one transaction, so nothing of it was kept."""


def role_script(*, owner_role: str = DEFAULT_OWNER_ROLE,
                gateway_role: str = DEFAULT_GATEWAY_ROLE, schema_name: str = DEFAULT_SCHEMA,
                statement_timeout: str = DEFAULT_STATEMENT_TIMEOUT,
                lock_timeout: str = DEFAULT_LOCK_TIMEOUT) -> str:
    """``roles.sql`` with these values, ready to execute as one simple query (or to feed to
    ``psql -f -``). Raises ``ConfigurationError`` for a value that is not a plain name or
    duration, before anything is sent."""
    check_schema(schema_name, "schema_name")
    values = {"owner_role": owner_role, "gateway_role": gateway_role,
              "schema_name": schema_name}
    for key, value in values.items():
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise ConfigurationError(f"{key} must match {_NAME.pattern}, not {value!r}")
    for key, value in (("statement_timeout", statement_timeout),
                       ("lock_timeout", lock_timeout)):
        if not isinstance(value, str) or not _DURATION.fullmatch(value):
            raise ConfigurationError(
                f"{key} must be a duration such as 5s or 500ms, not {value!r}")
        values[key] = value
    lines = [line for line in sql_text("roles.sql").splitlines()
             if not line.lstrip().startswith("\\")]

    def literal(match: re.Match[str]) -> str:
        # Every value was checked against a pattern without quotes above.
        return f"'{values[match[1]]}'"

    return _VARIABLE.sub(literal, "\n".join(lines) + "\n")


@attrs.frozen(slots=True)
class EffectTable:
    """An application table gateways write in fenced effects: ``schema.name``."""

    schema: str
    name: str

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}"


def effect_table(value: object, *, library_schema: str = DEFAULT_SCHEMA) -> EffectTable:
    """``value`` (``"schema.table"``, plain lower-case names) as an :class:`EffectTable`.
    The schema must be named (nothing depends on a search_path), and may not be the
    library's own: the gateway role must never hold more than its layout there."""
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) != 2 or not all(_NAME.fullmatch(part) for part in parts):
        raise ConfigurationError(
            "an effect table is schema.table, both plain lower-case SQL names (letters, "
            f"digits, _), such as app.outbox, not {value!r}")
    if parts[0] == library_schema:
        raise ConfigurationError(
            f"effect table {value}: schema {library_schema} holds the mos-lease tables, "
            "where the gateway role gets only the layout's privileges; keep application "
            "tables in a schema of their own")
    return EffectTable(parts[0], parts[1])


def effect_privileges(value: object) -> tuple[str, ...]:
    """``value`` (privilege names, or one string of them separated by commas) checked
    against :data:`EFFECT_PRIVILEGES`, upper-cased and without repeats."""
    names = [n for n in value.split(",") if n.strip()] if isinstance(value, str) else value
    if not isinstance(names, Iterable):
        raise ConfigurationError(f"effect privileges must be names, not {value!r}")
    chosen: list[str] = []
    for name in names:
        word = name.strip().upper() if isinstance(name, str) else name
        if word not in EFFECT_PRIVILEGES:
            raise ConfigurationError(
                f"effect privilege {name!r} is not one of {', '.join(EFFECT_PRIVILEGES)}")
        if word not in chosen:
            chosen.append(word)
    if not chosen:
        raise ConfigurationError("effect privileges: name at least one of "
                                 + ", ".join(EFFECT_PRIVILEGES))
    return tuple(chosen)


_FIND_EFFECT_TABLE: Final = query_text("effect_tables", "find.sql").encode("utf-8")


def effect_table_grants(conn: psycopg.Connection[Any], tables: Iterable[EffectTable], *,
                        gateway_role: str = DEFAULT_GATEWAY_ROLE,
                        privileges: Sequence[str] = EFFECT_PRIVILEGES) -> list[sql.Composed]:
    """The statements that let ``gateway_role`` write ``tables`` in fenced effects: USAGE
    on each table's schema, ``privileges`` on the table, USAGE on its serial columns'
    sequences. Reads the catalog on ``conn``; raises :class:`RoleSetupError` for a table
    that does not exist (create it first: the grants are on the table itself)."""
    if not _NAME.fullmatch(gateway_role):
        raise ConfigurationError(f"gateway_role must match {_NAME.pattern}, not "
                                 f"{gateway_role!r}")
    chosen = effect_privileges(privileges)
    role = sql.Identifier(gateway_role)
    statements: list[sql.Composed] = []
    for table in tables:
        found = conn.execute(_FIND_EFFECT_TABLE,
                             {"schema": table.schema, "table": table.name}).fetchone()
        assert found is not None  # the query always yields one row
        present, sequence_schemas, sequence_names = found
        if not present:
            raise RoleSetupError(
                f"effect table {table} does not exist: create it first (as its owner), then "
                "grant on it")
        statements.append(_grant_table(table, role, chosen))
        statements.extend(_GRANT_SEQUENCE.format(sequence=sql.Identifier(schema, name),
                                                 role=role)
                          for schema, name in zip(sequence_schemas, sequence_names, strict=True))
    return statements


_GRANT_TABLE: Final = sql.SQL(query_text("effect_tables", "grant.sql"))
_GRANT_SEQUENCE: Final = sql.SQL(query_text("effect_tables", "grant_sequence.sql"))


def _grant_table(table: EffectTable, role: sql.Identifier,
                 privileges: Sequence[str]) -> sql.Composed:
    return _GRANT_TABLE.format(
        schema=sql.Identifier(table.schema), table=sql.Identifier(table.schema, table.name),
        role=role, privileges=sql.SQL(", ").join(sql.SQL(p) for p in privileges))


def effect_table_script(tables: Iterable[str], *, gateway_role: str = DEFAULT_GATEWAY_ROLE,
                        schema_name: str = DEFAULT_SCHEMA,
                        privileges: Sequence[str] = EFFECT_PRIVILEGES) -> str:
    """The table grants of :func:`effect_table_grants` as text, for ``mos-lease roles
    --print``: without a connection, so without the serial columns' sequences."""
    if not _NAME.fullmatch(gateway_role):
        raise ConfigurationError(f"gateway_role must match {_NAME.pattern}, not "
                                 f"{gateway_role!r}")
    chosen = effect_privileges(privileges)
    checked = [effect_table(t, library_schema=schema_name) for t in tables]
    if not checked:
        return ""
    lines = ["-- Effect tables (a serial column's sequence also needs GRANT USAGE ON SEQUENCE, "
             "which `mos-lease roles --effect-table` grants when it runs)"]
    lines += [_grant_table(t, sql.Identifier(gateway_role), chosen).as_string(None).strip()
              for t in checked]
    return "\n".join(lines) + "\n"


def apply_roles(conn: psycopg.Connection[Any], **names: str) -> list[str]:
    """Run :func:`role_script` on ``conn`` (a superuser or CREATEROLE connection); return the
    script's notices (one says when the tables do not exist yet)."""
    script = role_script(**names).encode("utf-8")
    notices: list[str] = []

    def keep(diagnostic: psycopg.errors.Diagnostic) -> None:
        if diagnostic.message_primary:
            notices.append(diagnostic.message_primary)

    conn.add_notice_handler(keep)
    try:
        conn.execute(script)
    finally:
        conn.remove_notice_handler(keep)
    return notices


def as_role(conninfo: str, role: str) -> str:
    """``conninfo`` whose sessions act as ``role`` (``SET ROLE`` at connect, kept with any
    options the string already had): objects they create belong to ``role``."""
    if not _NAME.fullmatch(role):
        raise ConfigurationError(f"role must match {_NAME.pattern}, not {role!r}")
    options = conninfo_to_dict(conninfo).get("options") or ""
    return make_conninfo(conninfo, options=f"{options} -c role={role}".strip())


_PRESENT: Final = query_text("setup", "present.sql").encode("utf-8")


@attrs.frozen(slots=True)
class SetupReport:
    """What :func:`set_up` did, one line per step, for an operator to read."""

    steps: tuple[str, ...]
    version: int


def _connect(conninfo: str) -> psycopg.Connection[Any]:
    try:
        return psycopg.Connection.connect(conninfo, autocommit=True,
                                          application_name="mos-lease roles")
    except psycopg.Error as exc:
        raise RoleSetupError(f"cannot connect to PostgreSQL: {exc}") from exc


def run_roles(conninfo: str, *, effect_tables: Sequence[str] = (),
              privileges: Sequence[str] = EFFECT_PRIVILEGES, **names: str) -> list[str]:
    """Connect to ``conninfo`` and apply the role step, and grant the gateway role the
    ``effect_tables`` (``"schema.table"``) with ``privileges``, all in one transaction;
    return the script's notices."""
    role_script(**names)  # refuse bad names before connecting
    tables = [effect_table(t, library_schema=names.get("schema_name", DEFAULT_SCHEMA))
              for t in effect_tables]
    chosen = effect_privileges(privileges)
    gateway = names.get("gateway_role", DEFAULT_GATEWAY_ROLE)
    with _connect(conninfo) as conn:
        try:
            with conn.transaction():
                notices = apply_roles(conn, **names)
                for statement in effect_table_grants(conn, tables, gateway_role=gateway,
                                                     privileges=chosen):
                    conn.execute(statement)
            return notices
        except psycopg.Error as exc:
            raise RoleSetupError(f"role step failed: {exc}") from exc


def set_up(conninfo: str, *, owner_role: str = DEFAULT_OWNER_ROLE,
           gateway_role: str = DEFAULT_GATEWAY_ROLE, schema: str = DEFAULT_SCHEMA,
           statement_timeout: str = DEFAULT_STATEMENT_TIMEOUT,
           lock_timeout: str = DEFAULT_LOCK_TIMEOUT, owner_conninfo: str | None = None,
           allow_second_copy: bool = False, effect_tables: Sequence[str] = (),
           privileges: Sequence[str] = EFFECT_PRIVILEGES) -> SetupReport:
    """Bring a database to the working layout: the role step, ``migrate`` as the owner role,
    the role step again (with the ``effect_tables`` grants, as :func:`run_roles`).
    ``conninfo`` connects as a superuser (or a role with CREATEROLE that may act as the
    owner); migrations run as ``owner_conninfo`` if given, else on ``conninfo`` with ``SET
    ROLE owner_role``, so the owner owns every table. Idempotent."""
    names = {"owner_role": owner_role, "gateway_role": gateway_role, "schema_name": schema,
             "statement_timeout": statement_timeout, "lock_timeout": lock_timeout}
    role_script(**names)  # refuse bad names before connecting
    for table in effect_tables:
        effect_table(table, library_schema=schema)
    effect_privileges(privileges)
    steps: list[str] = []
    with _connect(conninfo) as conn:
        params = {"owner": owner_role, "gateway": gateway_role, "schema": schema}
        try:
            before = conn.execute(_PRESENT, params).fetchone()
            apply_roles(conn, **names)
        except psycopg.Error as exc:
            raise RoleSetupError(f"role step failed: {exc}") from exc
    assert before is not None
    made = [what for what, present in zip(
        (f"role {owner_role}", f"role {gateway_role}", f"schema {schema}"), before,
        strict=True) if not present]
    steps.append(f"roles: created {', '.join(made)}" if made
                 else f"roles: {owner_role}, {gateway_role} and schema {schema} exist")
    migrator = owner_conninfo if owner_conninfo is not None else as_role(conninfo, owner_role)
    applied = migrate(migrator, schema=schema, allow_second_copy=allow_second_copy)
    steps.append(f"migrate (as {owner_role}): "
                 + (f"applied migrations {', '.join(map(str, applied))}" if applied
                    else "schema is up to date"))
    run_roles(conninfo, effect_tables=effect_tables, privileges=privileges, **names)
    steps.append(f"roles: granted {gateway_role} its privileges on the tables of {schema}")
    if effect_tables:
        steps.append(f"roles: granted {gateway_role} {', '.join(effect_privileges(privileges))} "
                     f"on effect tables {', '.join(effect_tables)}")
    version = max(applied_versions(conninfo, schema=schema), default=0)
    return SetupReport(tuple(steps), version)
