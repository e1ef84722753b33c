-- The lock step of heartbeat, release and takeover (see guarded_write.sql): this identity's
-- row, FOR UPDATE, before the clock is read.
    SELECT 1
    FROM {schema}.logical_agent_connector_leases AS k
    WHERE k.tenant_id = %(tenant_id)s
      AND k.logical_agent_id = %(logical_agent_id)s
      AND k.binding_id = %(binding_id)s
    FOR UPDATE
