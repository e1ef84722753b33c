-- Acquire: insert-only creation at epoch 1. An existing row, in any state, makes this a
-- no-op (and so no audit row is written). The holder's metadata is set here (a JSON object
-- of strings, checked by the library before it is sent).
    INSERT INTO {schema}.logical_agent_connector_leases AS l
        (tenant_id, logical_agent_id, binding_id, lease_id, connector_id, allowed_scopes,
         epoch, acquired_at, heartbeat_at, expires_at, released_at, updated_at,
         holder_metadata)
    SELECT %(tenant_id)s, %(logical_agent_id)s, %(binding_id)s, %(lease_id)s,
           %(connector_id)s, %(scopes)s::text[], 1, t.now, t.now,
           t.now + %(ttl)s::interval, NULL, t.now, %(metadata)s::jsonb
    FROM t
    ON CONFLICT (tenant_id, logical_agent_id, binding_id) DO NOTHING
