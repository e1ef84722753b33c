-- The current row of one identity (or none) and the database time, read together.
SELECT t.now, l.lease_id, l.connector_id, l.allowed_scopes, l.epoch, l.acquired_at,
       l.heartbeat_at, l.expires_at, l.released_at, l.updated_at, l.holder_metadata
FROM (SELECT clock_timestamp() + %(offset)s::interval AS now) AS t
LEFT JOIN {schema}.logical_agent_connector_leases AS l
    ON l.tenant_id = %(tenant_id)s
   AND l.logical_agent_id = %(logical_agent_id)s
   AND l.binding_id = %(binding_id)s
