-- Which migrations have been applied, in the schema they built. Created (if missing) by the
-- migration runner before anything else; concurrent migrators serialize on an ACCESS
-- EXCLUSIVE lock of this table. The runner also writes the schema version into the table's
-- comment, which every role can read (the gateway role has no privilege on the table).
CREATE TABLE IF NOT EXISTS {schema}.mos_lease_schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
