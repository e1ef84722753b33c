-- The audit log's kind ('p' once partitioned), its owner and the connected role.
SELECT c.relkind::text, pg_get_userbyid(c.relowner), current_user::text
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(name)s
