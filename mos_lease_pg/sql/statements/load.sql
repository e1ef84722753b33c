-- The current row of one identity (or none) and the database time, read together. The
-- holder metadata comes back NULL when it is empty, as it is for most leases: the client then
-- parses no JSON (every statement that returns a lease row does the same).
SELECT t.now, l.lease_id, l.connector_id, l.allowed_scopes, l.epoch, l.acquired_at,
       l.heartbeat_at, l.expires_at, l.released_at, l.updated_at,
       NULLIF(l.holder_metadata, '{}'::jsonb)
FROM (SELECT clock_timestamp() + %(offset)s::interval AS now) AS t
LEFT JOIN {schema}.logical_agent_connector_leases AS l
    ON l.tenant_id = %(tenant_id)s
   AND l.logical_agent_id = %(logical_agent_id)s
   AND l.binding_id = %(binding_id)s
