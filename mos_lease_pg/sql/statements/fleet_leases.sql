-- A fleet's member leases and every other lease whose last holder is one of their
-- connectors (of one tenant only, if given), with the database time, in one read
-- (mos-lease status --fleet; mos_lease.fleet.census judges the rows). The time comes back
-- on every row, and alone (the lease columns NULL) when no row matches.
WITH members AS (
    SELECT m.connector_id
    FROM {schema}.logical_agent_connector_leases AS m
    WHERE m.tenant_id = %(fleet_tenant)s AND m.logical_agent_id = %(fleet)s
)
SELECT t.now, l.tenant_id, l.logical_agent_id, l.binding_id, l.lease_id, l.connector_id,
       l.allowed_scopes, l.epoch, l.acquired_at, l.heartbeat_at, l.expires_at, l.released_at,
       l.updated_at, l.holder_metadata
FROM (SELECT clock_timestamp() + %(offset)s::interval AS now) AS t
LEFT JOIN {schema}.logical_agent_connector_leases AS l
    ON (l.tenant_id = %(fleet_tenant)s AND l.logical_agent_id = %(fleet)s)
    OR (l.tenant_id <> %(fleet_tenant)s
        AND (%(tenant_id)s::text IS NULL OR l.tenant_id = %(tenant_id)s)
        AND l.connector_id IN (SELECT connector_id FROM members))
ORDER BY l.tenant_id, l.logical_agent_id, l.binding_id
