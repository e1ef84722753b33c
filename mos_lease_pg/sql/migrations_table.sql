-- Which migrations have been applied. Created (if missing) by the migration runner before
-- anything else; concurrent migrators serialize on an ACCESS EXCLUSIVE lock of this table.
CREATE TABLE IF NOT EXISTS mos_lease_schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
