-- The audit rows of a batched heartbeat (see renew_many.sql): one per lease renewed, from
-- the UPDATE's RETURNING.
    INSERT INTO {schema}.connector_lease_audit_log
        (event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id,
         connector_id, epoch, correlation_id, recorded_at)
    SELECT w.event_id, 'heartbeat', 'renewed', NULL, w.tenant_id, w.logical_agent_id,
           w.binding_id, w.connector_id, w.epoch, w.correlation_id, t.now
    FROM written AS w, t
