-- The database clock against the newest stamp of any lease row (every write stamps
-- updated_at with the clock, and no other stamp of a row is later): a clock that reads
-- earlier than that stamp has stepped back since it was written.
SELECT extract(epoch FROM max(l.updated_at) - clock_timestamp())::float8, count(*)
FROM {schema}.logical_agent_connector_leases AS l
