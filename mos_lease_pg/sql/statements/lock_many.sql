-- The lock step of a batched takeover or release (takeover_many.sql, release_many.sql): the
-- rows of the requests, FOR UPDATE in identity order (LockRows sits above the sort, so two
-- batches sharing rows cannot deadlock), skipping a row another transaction holds. Returned
-- as found: under READ COMMITTED a locking read returns the newest version, the one the
-- write then judges, so a refused write can name its refusal without a second read.
    SELECT k.tenant_id, k.logical_agent_id, k.binding_id, k.lease_id, k.connector_id,
           k.allowed_scopes, k.epoch, k.acquired_at, k.heartbeat_at, k.expires_at,
           k.released_at, k.updated_at, k.holder_metadata
    FROM {schema}.logical_agent_connector_leases AS k
    WHERE (k.tenant_id, k.logical_agent_id, k.binding_id) IN
          (SELECT r.tenant_id, r.logical_agent_id, r.binding_id FROM req AS r)
    ORDER BY k.tenant_id, k.logical_agent_id, k.binding_id
    FOR UPDATE SKIP LOCKED
