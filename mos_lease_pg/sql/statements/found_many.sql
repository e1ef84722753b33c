-- The final SELECT of a batched takeover or release: one row per request, in request order.
-- The time; the new lease columns if the write applied (NULLs if not); the row as `locked`
-- found it (NULLs if it was not locked); and whether the row exists but another transaction
-- held it, so it was skipped (a row that does not exist is a failed guard, as for a single
-- write; the existence check runs only for a request whose row was not locked). It counts
-- `notified`, so the notices in it really are sent within this statement's transaction.
SELECT t.now, w.lease_id, w.connector_id, w.allowed_scopes, w.epoch, w.acquired_at,
       w.heartbeat_at, w.expires_at, w.released_at, w.updated_at,
       NULLIF(w.holder_metadata, '{}'::jsonb),
       k.lease_id, k.connector_id, k.allowed_scopes, k.epoch, k.acquired_at,
       k.heartbeat_at, k.expires_at, k.released_at, k.updated_at,
       NULLIF(k.holder_metadata, '{}'::jsonb),
       k.tenant_id IS NULL AND EXISTS (
           SELECT FROM {schema}.logical_agent_connector_leases AS s
           WHERE s.tenant_id = r.tenant_id AND s.logical_agent_id = r.logical_agent_id
             AND s.binding_id = r.binding_id) AS skipped
FROM t CROSS JOIN req AS r
LEFT JOIN written AS w
    ON w.tenant_id = r.tenant_id AND w.logical_agent_id = r.logical_agent_id
   AND w.binding_id = r.binding_id
LEFT JOIN locked AS k
    ON k.tenant_id = r.tenant_id AND k.logical_agent_id = r.logical_agent_id
   AND k.binding_id = r.binding_id
CROSS JOIN (SELECT count(*) FROM notified) AS sent
ORDER BY r.ord
