-- The version every role can read (preflight): the gateway role cannot read the table.
COMMENT ON TABLE {schema}.mos_lease_schema_migrations IS {comment}
