-- The full match of heartbeat and release: the row of this identity, held by this connector
-- under this lease UUID and epoch, not released and not expired at database time.
    WHERE l.tenant_id = %(tenant_id)s
      AND l.logical_agent_id = %(logical_agent_id)s
      AND l.binding_id = %(binding_id)s
      AND l.connector_id = %(connector_id)s
      AND l.lease_id = %(lease_id)s
      AND l.epoch = %(epoch)s
      AND l.released_at IS NULL
      AND l.expires_at > t.now
