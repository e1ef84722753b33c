"""The least-privilege role layout (``sql/roles.sql``), for callers that are not psql.

``roles.sql`` is written for ``psql -v name=value -f roles.sql``. :func:`role_script`
renders the same file for a driver: psql meta-commands are dropped and the ``:'name'``
variables become SQL literals, so there is one layout, not two.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

from mos_lease.errors import ConfigurationError
from mos_lease_pg.statements import sql_text

DEFAULT_OWNER_ROLE = "mos_lease_owner"
DEFAULT_GATEWAY_ROLE = "mos_lease_gateway"
DEFAULT_SCHEMA = "mos_lease"

_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_DURATION = re.compile(r"[0-9]+\s*(ms|s|min|h)?")
_VARIABLE = re.compile(r":'([a-z_]+)'")


def role_script(*, owner_role: str = DEFAULT_OWNER_ROLE,
                gateway_role: str = DEFAULT_GATEWAY_ROLE, schema_name: str = DEFAULT_SCHEMA,
                statement_timeout: str = "5s", lock_timeout: str = "2s") -> str:
    """``roles.sql`` with these values, ready to execute as one simple query."""
    values = {"owner_role": owner_role, "gateway_role": gateway_role,
              "schema_name": schema_name}
    for key, value in values.items():
        if not _NAME.fullmatch(value):
            raise ConfigurationError(f"{key} must match {_NAME.pattern}")
    for key, value in (("statement_timeout", statement_timeout),
                       ("lock_timeout", lock_timeout)):
        if not _DURATION.fullmatch(value):
            raise ConfigurationError(f"{key} must be a duration such as 5s or 500ms")
        values[key] = value
    lines = [line for line in sql_text("roles.sql").splitlines()
             if not line.lstrip().startswith("\\")]

    def literal(match: re.Match[str]) -> str:
        # Every value was checked against a pattern without quotes above.
        return f"'{values[match[1]]}'"

    return _VARIABLE.sub(literal, "\n".join(lines) + "\n")


def apply_roles(conn: psycopg.Connection[Any], **names: str) -> None:
    """Run :func:`role_script` on ``conn`` (a superuser or CREATEROLE connection)."""
    conn.execute(role_script(**names).encode("utf-8"))
