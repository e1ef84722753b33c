-- The migration files' DDL is unqualified: pin where it lands (and what it resolves) to the
-- schema, then pg_catalog, then pg_temp last so no temporary object can shadow.
SET LOCAL search_path = {schema}, pg_catalog, pg_temp
