-- Heartbeat: full match on an active lease (identity, connector, lease UUID, epoch, not
-- released, not expired at database time); expiry moves to now + ttl.
    UPDATE {schema}.logical_agent_connector_leases AS l
    SET heartbeat_at = t.now, expires_at = t.now + %(ttl)s::interval, updated_at = t.now
    FROM t
    {active_holder}
