"""The least-privilege role layout (``sql/roles.sql``), for callers that are not psql, and
the whole first-time order for a new database (:func:`set_up`).

``roles.sql`` is written for ``psql -v name=value -f roles.sql``. :func:`role_script`
renders the same file for a driver: psql meta-commands are dropped and the ``:'name'``
variables become SQL literals, so there is one layout, not two. The file is read from the
installed package, so a wheel install needs no source tree.

The script grants on the tables that exist, and before the first migrate none do: the
working order for a new database is the script, ``migrate`` as the owner role, the script
again. :func:`set_up` runs exactly that; running it again changes nothing.
"""

from __future__ import annotations

import re
from typing import Any, Final

import attrs
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from mos_lease.errors import ConfigurationError, MosLeaseError
from mos_lease_pg.admin.migrations import applied_versions, migrate
from mos_lease_pg.statements import DEFAULT_SCHEMA, check_schema, query_text, sql_text

DEFAULT_OWNER_ROLE: Final = "mos_lease_owner"
DEFAULT_GATEWAY_ROLE: Final = "mos_lease_gateway"
DEFAULT_STATEMENT_TIMEOUT: Final = "5s"
DEFAULT_LOCK_TIMEOUT: Final = "2s"

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


def run_roles(conninfo: str, **names: str) -> list[str]:
    """Connect to ``conninfo`` and apply the role step; return its notices."""
    role_script(**names)  # refuse bad names before connecting
    with _connect(conninfo) as conn:
        try:
            return apply_roles(conn, **names)
        except psycopg.Error as exc:
            raise RoleSetupError(f"role step failed: {exc}") from exc


def set_up(conninfo: str, *, owner_role: str = DEFAULT_OWNER_ROLE,
           gateway_role: str = DEFAULT_GATEWAY_ROLE, schema: str = DEFAULT_SCHEMA,
           statement_timeout: str = DEFAULT_STATEMENT_TIMEOUT,
           lock_timeout: str = DEFAULT_LOCK_TIMEOUT, owner_conninfo: str | None = None,
           allow_second_copy: bool = False) -> SetupReport:
    """Bring a database to the working layout: the role step, ``migrate`` as the owner role,
    the role step again. ``conninfo`` connects as a superuser (or a role with CREATEROLE
    that may act as the owner); migrations run as ``owner_conninfo`` if given, else on
    ``conninfo`` with ``SET ROLE owner_role``, so the owner owns every table. Idempotent."""
    names = {"owner_role": owner_role, "gateway_role": gateway_role, "schema_name": schema,
             "statement_timeout": statement_timeout, "lock_timeout": lock_timeout}
    role_script(**names)  # refuse bad names before connecting
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
    run_roles(conninfo, **names)
    steps.append(f"roles: granted {gateway_role} its privileges on the tables of {schema}")
    version = max(applied_versions(conninfo, schema=schema), default=0)
    return SetupReport(tuple(steps), version)
