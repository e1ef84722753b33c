SELECT c.relname, pg_get_expr(c.relpartbound, c.oid)
FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = '{schema}.connector_lease_audit_log'::regclass
