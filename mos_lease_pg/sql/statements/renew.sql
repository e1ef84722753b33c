-- Heartbeat: full match on an active lease (identity, connector, lease UUID, epoch, not
-- released, not expired at database time); expiry moves to now + ttl.
    UPDATE logical_agent_connector_leases AS l
    SET heartbeat_at = t.now, expires_at = t.now + %(ttl)s::interval, updated_at = t.now
    FROM t
    WHERE l.tenant_id = %(tenant_id)s
      AND l.logical_agent_id = %(logical_agent_id)s
      AND l.binding_id = %(binding_id)s
      AND l.connector_id = %(connector_id)s
      AND l.lease_id = %(lease_id)s
      AND l.epoch = %(epoch)s
      AND l.released_at IS NULL
      AND l.expires_at > t.now
