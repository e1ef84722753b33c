"""The SQL shipped in this package, loaded and qualified with a schema.

Every statement names its schema; nothing depends on the session's ``search_path`` (a role
whose search_path finds another copy of the tables, or none, must neither write to that copy
nor fail obscurely). The files write ``{schema}.table`` and :meth:`Template.at` substitutes
the quoted schema of the store (``ConnectionSettings.schema``). Loading refuses a statement
that names a library table without ``{schema}.`` (see :func:`unqualified`), at import time.
The catalogue of the store's own calls built from these is :mod:`mos_lease_pg.statements`.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Final

import attrs
from psycopg import sql

from mos_lease.errors import ConfigurationError


def sql_text(*path: str) -> str:
    """The text of a ``.sql`` file shipped in the package, e.g. ``sql_text("roles.sql")``."""
    return resources.files("mos_lease_pg").joinpath("sql", *path).read_text("utf-8")


_COMMENT_LINE = re.compile(r"^\s*--.*\n", re.MULTILINE)

DEFAULT_SCHEMA: Final = "mos_lease"
"""The schema of the mos-lease tables unless ``ConnectionSettings(schema=...)`` or
``--schema`` names another."""
# A plain (unquoted, lower-case) identifier: it is substituted into SQL as "name", so it must
# not be able to close the quotes, and it must mean the same thing quoted or not (psql,
# roles.sql and operators type it unquoted).
_PLAIN_IDENTIFIER: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}\Z")
SCHEMA_MARK: Final = "{schema}"
# Every relation the migrations create. A statement names each only as ``{schema}.name``.
LIBRARY_TABLES: Final = ("logical_agent_connector_leases", "connector_lease_audit_log",
                         "connector_resource_epochs", "mos_lease_settings",
                         "mos_lease_schema_migrations")
_TABLE_NAME: Final = re.compile(r"(?<![\w$])(" + "|".join(LIBRARY_TABLES) + r")(?![\w$])")


class UnqualifiedStatement(Exception):
    """A statement shipped in this package names a library table without its schema: a
    packaging bug, refused when the statement is loaded."""


def check_schema(value: object, field: str = "schema") -> str:
    """``value`` if it is a plain lower-case identifier of at most 63 characters."""
    if not isinstance(value, str) or not _PLAIN_IDENTIFIER.match(value):
        raise ConfigurationError(
            f"{field} must be a plain lower-case SQL identifier (letters, digits, _; at most "
            f"63 characters, not starting with a digit), not {value!r}")
    return value


def quoted(schema: str) -> str:
    """The schema as a quoted SQL identifier (``check_schema`` keeps quotes out of it)."""
    return f'"{check_schema(schema)}"'


def unqualified(text: str) -> list[str]:
    """The library tables ``text`` names without ``{schema}.`` in front, in order."""
    return [m[1] for m in _TABLE_NAME.finditer(text)
            if not text.endswith(SCHEMA_MARK + ".", 0, m.start())]


def render(text: str, schema: str) -> str:
    """``text`` with its ``{schema}`` marks replaced by the quoted ``schema``."""
    return text.replace(SCHEMA_MARK, quoted(schema))


def checked(name: str, text: str) -> str:
    """``text`` of statement file ``name``, refused if it names a table unqualified."""
    missing = unqualified(text)
    if missing:
        raise UnqualifiedStatement(
            f"{name} names {', '.join(sorted(set(missing)))} without {SCHEMA_MARK}.: every "
            "statement must name its schema")
    return text


def query_text(*path: str) -> str:
    """A shipped ``.sql`` file as it is sent, refused if it names a library table without
    ``{schema}.``. Whole-line comments are for readers of the file, not for the server:
    dropping them keeps the text (sent and hashed on every call) short, and keeps a stray
    "%" in a comment from being taken for a parameter."""
    return checked("/".join(path), _COMMENT_LINE.sub("", sql_text(*path)))


def statement_text(name: str) -> str:
    return query_text("statements", name)


def schema_query(schema: str, *path: str,
                 **marks: str | sql.Composable) -> sql.SQL | sql.Composed:
    """An administrative ``.sql`` file (migrate, audit retention) for ``schema``: its
    ``{schema}`` marks replaced, and each other ``{mark}`` by ``marks[mark]``: a string is
    an identifier (a partition, say), quoted by psycopg; anything else is used as given."""
    text = sql.SQL(render(query_text(*path), schema))
    if not marks:
        return text
    return text.format(**{mark: sql.Identifier(value) if isinstance(value, str) else value
                          for mark, value in marks.items()})


@attrs.frozen(slots=True)
class Statement:
    name: str
    # bytes, so psycopg takes a text read from a file as a query; psycopg converts its
    # ``%(name)s`` placeholders. One object per statement and schema (see Template), so a
    # cursor that runs it again keeps its adaptation context.
    text: bytes

    @classmethod
    def of(cls, name: str, text: str) -> Statement:
        return cls(name, text.encode("utf-8"))


@attrs.frozen(slots=True)
class Template:
    """A statement whose text says ``{schema}``; :meth:`at` gives it for one schema."""

    name: str
    text: str
    # Rendered once per schema (a store uses one; a dict lookup per call is the whole cost).
    _rendered: dict[str, Statement] = attrs.field(factory=dict, init=False, eq=False,
                                                  repr=False)

    def at(self, schema: str) -> Statement:
        found = self._rendered.get(schema)
        if found is None:
            found = self._rendered[schema] = Statement.of(self.name, render(self.text, schema))
        return found
