-- The lock step of heartbeat, release and takeover (see guarded_write.sql): this identity's
-- row, FOR UPDATE, before the clock is read. The row is returned too: under READ COMMITTED a
-- locking read returns the newest version, the one the write then judges, so a refused write
-- can name its refusal without a second read.
    SELECT k.lease_id, k.connector_id, k.allowed_scopes, k.epoch, k.acquired_at,
           k.heartbeat_at, k.expires_at, k.released_at, k.updated_at, k.holder_metadata
    FROM {schema}.logical_agent_connector_leases AS k
    WHERE k.tenant_id = %(tenant_id)s
      AND k.logical_agent_id = %(logical_agent_id)s
      AND k.binding_id = %(binding_id)s
    FOR UPDATE
