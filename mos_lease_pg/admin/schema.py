"""A canonical text description of the schema, read from the catalogs.

Two schemas are the same exactly when their descriptions are equal: tables with their
storage options, columns in order with types, defaults, nullability and identity,
constraints, indexes, triggers and functions. Schema names are replaced by ``@``, so
schemas of different names compare.
"""

from __future__ import annotations

from typing import Any, Final

import psycopg

from mos_lease_pg.sql_files import query_text

# One query per kind of catalog fact, in sql/describe/ (the kinds, in this order).
_KINDS: Final = ("table", "column", "constraint", "index", "trigger", "function", "sequence")


def describe_schema(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """One line per catalog fact of ``schema``, sorted within each kind."""
    lines: list[str] = []
    for kind in _KINDS:
        for row in conn.execute(query_text("describe", f"{kind}.sql").encode("utf-8"),
                                {"schema": schema}):
            text = " | ".join(str(col) for col in row)
            # pg_get_*def qualify names with the schema: make schemas of any name compare.
            text = text.replace(f'"{schema}".', "@.").replace(f"{schema}.", "@.")
            lines.append(f"{kind}: {' '.join(text.split())}")
    return lines
