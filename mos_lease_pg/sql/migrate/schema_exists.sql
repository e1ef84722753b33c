-- Whether the schema exists (creating it needs a privilege the owner role may lack).
SELECT 1 FROM pg_namespace WHERE nspname = %(schema)s
