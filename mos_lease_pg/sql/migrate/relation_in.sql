-- Whether schema %(schema)s holds a relation named %(name)s: the lease table (this schema
-- already is the copy) or the bookkeeping table (it was migrated before).
SELECT 1
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.relname = %(name)s AND n.nspname = %(schema)s
