INSERT INTO {schema}.mos_lease_schema_migrations (version, name) VALUES (%(version)s, %(name)s)
