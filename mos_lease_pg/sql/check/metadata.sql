-- Every lease row's holder metadata that is not empty, for `mos-lease check` to judge with
-- the library's own rule (mos_lease.metadata.check_metadata): the gateway role may execute
-- none of the schema's functions, so 0010's mos_lease_metadata_problem() is not called.
SELECT l.holder_metadata
FROM {schema}.logical_agent_connector_leases AS l
WHERE l.holder_metadata <> '{}'::jsonb
