SELECT c.relname, a.attnum::text, a.attname, format_type(a.atttypid, a.atttypmod),
       a.attnotnull::text, a.attidentity::text, a.attgenerated::text,
       coalesce(pg_get_expr(d.adbin, d.adrelid), '')
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p') AND a.attnum > 0
  AND NOT a.attisdropped
ORDER BY 1, a.attnum
