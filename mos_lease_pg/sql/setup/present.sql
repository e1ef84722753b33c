-- Which parts of the layout exist; read before and after, so the report says what it made.
SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = %(owner)s),
       EXISTS (SELECT FROM pg_roles WHERE rolname = %(gateway)s),
       EXISTS (SELECT FROM pg_namespace WHERE nspname = %(schema)s)
