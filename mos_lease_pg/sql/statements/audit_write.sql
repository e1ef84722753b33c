-- The audit row of a guarded write (see guarded_write.sql): inserted from the write's
-- RETURNING, so it exists exactly when the write changed the row, stamped with its time.
    INSERT INTO {schema}.connector_lease_audit_log
        (event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id,
         connector_id, epoch, correlation_id, recorded_at)
    SELECT %(event_id)s, %(event)s, %(outcome)s, %(reason)s, %(entry_tenant_id)s,
           %(entry_logical_agent_id)s, %(entry_binding_id)s, %(entry_connector_id)s,
           CASE WHEN w.epoch IS NOT NULL THEN %(entry_epoch)s::numeric END,
           %(correlation_id)s, t.now
    FROM written AS w, t
