-- Concurrent migrators queue here; each version is then checked and applied by one of them.
LOCK TABLE {schema}.mos_lease_schema_migrations IN ACCESS EXCLUSIVE MODE
