"""A canonical text description of the schema, read from the catalogs.

Two schemas are the same exactly when their descriptions are equal: tables with their
storage options, columns in order with types, defaults, nullability and identity,
constraints, indexes, triggers and functions. Schema names are replaced by ``@``, so
schemas of different names compare.
"""

from __future__ import annotations

from typing import Any

import psycopg

_QUERIES: tuple[tuple[str, bytes], ...] = (
    ("table", b"""
        SELECT c.relname, c.relkind::text, coalesce(array_to_string(c.reloptions, ','), '')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
        ORDER BY 1"""),
    ("column", b"""
        SELECT c.relname, a.attnum::text, a.attname, format_type(a.atttypid, a.atttypmod),
               a.attnotnull::text, a.attidentity::text, a.attgenerated::text,
               coalesce(pg_get_expr(d.adbin, d.adrelid), '')
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p') AND a.attnum > 0
          AND NOT a.attisdropped
        ORDER BY 1, a.attnum"""),
    ("constraint", b"""
        SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid)
        FROM pg_constraint k
        JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1, 2"""),
    ("index", b"""
        SELECT c.relname, pg_get_indexdef(i.indexrelid)
        FROM pg_index i
        JOIN pg_class c ON c.oid = i.indrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1, 2"""),
    ("trigger", b"""
        SELECT c.relname, t.tgname, t.tgenabled::text, pg_get_triggerdef(t.oid)
        FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND NOT t.tgisinternal
        ORDER BY 1, 2"""),
    ("function", b"""
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1, 2"""),
    ("sequence", b"""
        SELECT c.relname, format_type(s.seqtypid, NULL), s.seqstart::text,
               s.seqincrement::text, s.seqmax::text, s.seqmin::text, s.seqcycle::text
        FROM pg_sequence s
        JOIN pg_class c ON c.oid = s.seqrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1"""),
)


def describe_schema(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """One line per catalog fact of ``schema``, sorted within each kind."""
    lines: list[str] = []
    for kind, query in _QUERIES:
        for row in conn.execute(query, {"schema": schema}):
            text = " | ".join(str(col) for col in row)
            # pg_get_*def qualify names with the schema: make schemas of any name compare.
            text = text.replace(f'"{schema}".', "@.").replace(f"{schema}.", "@.")
            lines.append(f"{kind}: {' '.join(text.split())}")
    return lines
