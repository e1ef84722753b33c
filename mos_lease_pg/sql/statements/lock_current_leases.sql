-- The lock of lock_current_lease.sql for several fenced effects at once (effect_batches.py):
-- every key's current lease row locked FOR SHARE (effects may run side by side, lease writes
-- wait), then the clock read after the locks are held; one row per key, in the keys' order,
-- with the same columns as lock_current_lease.sql (NULLs for a key without a row).
WITH k AS (
    SELECT * FROM unnest(%(tenant_ids)s::text[], %(logical_agent_ids)s::text[],
                         %(binding_ids)s::text[]) WITH ORDINALITY
        AS k(tenant_id, logical_agent_id, binding_id, ord)
), locked AS MATERIALIZED (
    SELECT l.tenant_id, l.logical_agent_id, l.binding_id, l.lease_id, l.connector_id,
           l.allowed_scopes, l.epoch, l.acquired_at, l.heartbeat_at, l.expires_at,
           l.released_at, l.updated_at
    FROM {schema}.logical_agent_connector_leases AS l
    WHERE (l.tenant_id, l.logical_agent_id, l.binding_id) IN (
        SELECT k.tenant_id, k.logical_agent_id, k.binding_id FROM k)
    FOR SHARE
)
SELECT clock_timestamp(), l.lease_id, l.connector_id, l.allowed_scopes, l.epoch,
       l.acquired_at, l.heartbeat_at, l.expires_at, l.released_at, l.updated_at
FROM k
LEFT JOIN locked AS l
    ON l.tenant_id = k.tenant_id AND l.logical_agent_id = k.logical_agent_id
   AND l.binding_id = k.binding_id
ORDER BY k.ord
