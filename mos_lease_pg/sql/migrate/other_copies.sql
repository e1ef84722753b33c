-- The other schemas of this database that hold the lease table %(name)s.
SELECT n.nspname
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.relname = %(name)s AND c.relkind IN ('r', 'p') AND n.nspname <> %(schema)s
ORDER BY 1
