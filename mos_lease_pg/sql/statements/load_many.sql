-- The current rows of several identities (or none) and the database time, read together:
-- load.sql for many reads at once (mos_lease_pg/coalesce.py). One row per key given, with
-- its position (duplicates included), each with the same columns and the same time as
-- load.sql would give it. The time is read once, in a materialized CTE: a subquery could be
-- scanned again for each key, reading the clock again. The keys are sent in binary
-- (`%(name)b`), as renew_many.sql's arrays are.
WITH t AS MATERIALIZED (SELECT clock_timestamp() + %(offset)s::interval AS now)
SELECT k.ord, t.now, l.lease_id, l.connector_id, l.allowed_scopes, l.epoch, l.acquired_at,
       l.heartbeat_at, l.expires_at, l.released_at, l.updated_at,
       NULLIF(l.holder_metadata, '{}'::jsonb)
FROM t
CROSS JOIN unnest(%(tenant_ids)b::text[], %(logical_agent_ids)b::text[],
                  %(binding_ids)b::text[])
    WITH ORDINALITY AS k(tenant_id, logical_agent_id, binding_id, ord)
LEFT JOIN {schema}.logical_agent_connector_leases AS l
    ON l.tenant_id = k.tenant_id
   AND l.logical_agent_id = k.logical_agent_id
   AND l.binding_id = k.binding_id
ORDER BY k.ord
