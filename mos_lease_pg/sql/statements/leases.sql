-- Every lease row, or those of one tenant, in identity order.
SELECT l.tenant_id, l.logical_agent_id, l.binding_id, l.lease_id, l.connector_id,
       l.allowed_scopes, l.epoch, l.acquired_at, l.heartbeat_at, l.expires_at, l.released_at,
       l.updated_at, l.holder_metadata
FROM {schema}.logical_agent_connector_leases AS l
WHERE %(tenant_id)s::text IS NULL OR l.tenant_id = %(tenant_id)s
ORDER BY l.tenant_id, l.logical_agent_id, l.binding_id
