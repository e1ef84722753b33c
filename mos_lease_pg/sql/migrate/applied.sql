SELECT version FROM {schema}.mos_lease_schema_migrations
