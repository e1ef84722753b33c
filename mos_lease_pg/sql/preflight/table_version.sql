-- The schema's version from the bookkeeping table itself, for a role that may read it when
-- the table's comment (written by every migrate) is missing.
SELECT max(version) FROM {schema}.mos_lease_schema_migrations
