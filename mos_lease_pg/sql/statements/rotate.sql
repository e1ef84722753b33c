-- Takeover: compare-and-set on the expected epoch (takeover_guard.sql). The lease UUID
-- rotates and the epoch rises by one in the same write. The new holder's metadata replaces
-- the old one's ('{}' when it set none).
    UPDATE {schema}.logical_agent_connector_leases AS l
    SET lease_id = %(new_lease_id)s, epoch = l.epoch + 1, connector_id = %(connector_id)s,
        allowed_scopes = %(scopes)s::text[], acquired_at = t.now, heartbeat_at = t.now,
        expires_at = t.now + %(ttl)s::interval, released_at = NULL, updated_at = t.now,
        holder_metadata = %(metadata)s::jsonb
    FROM t
    {takeover_guard}
