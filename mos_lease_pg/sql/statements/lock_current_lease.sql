-- A fenced effect's lock on the current lease row (FOR SHARE: effects may run side by side,
-- lease writes wait), then the clock read after it (see effects.py).
WITH locked AS MATERIALIZED (
    SELECT lease_id, connector_id, allowed_scopes, epoch, acquired_at, heartbeat_at,
           expires_at, released_at, updated_at
    FROM {schema}.logical_agent_connector_leases
    WHERE tenant_id = %(tenant_id)s
      AND logical_agent_id = %(logical_agent_id)s
      AND binding_id = %(binding_id)s
    FOR SHARE
)
SELECT clock_timestamp(), l.lease_id, l.connector_id, l.allowed_scopes, l.epoch,
       l.acquired_at, l.heartbeat_at, l.expires_at, l.released_at, l.updated_at
FROM (SELECT 1) AS one
LEFT JOIN locked AS l ON true
