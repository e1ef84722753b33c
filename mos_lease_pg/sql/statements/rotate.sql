-- Takeover: compare-and-set on the expected epoch. The lease UUID rotates and the epoch rises
-- by one in the same write, never past the bigint maximum. An active lease is replaced only
-- when the policy allowed preemption; an expired or released one always may be. Never at a
-- time earlier than the row's latest stamp (machine.clock_refusal: the clock stepped back).
-- The new holder's metadata replaces the old one's ('{}' when it set none).
    UPDATE {schema}.logical_agent_connector_leases AS l
    SET lease_id = %(new_lease_id)s, epoch = l.epoch + 1, connector_id = %(connector_id)s,
        allowed_scopes = %(scopes)s::text[], acquired_at = t.now, heartbeat_at = t.now,
        expires_at = t.now + %(ttl)s::interval, released_at = NULL, updated_at = t.now,
        holder_metadata = %(metadata)s::jsonb
    FROM t
    WHERE l.tenant_id = %(tenant_id)s
      AND l.logical_agent_id = %(logical_agent_id)s
      AND l.binding_id = %(binding_id)s
      AND l.epoch = %(expected_epoch)s
      AND l.epoch < 9223372036854775807
      AND (%(preempt_active)s::boolean OR l.released_at IS NOT NULL OR l.expires_at <= t.now)
      AND l.updated_at <= t.now
