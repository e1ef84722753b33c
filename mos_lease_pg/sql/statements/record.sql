-- One audit row (a refusal or a grant issue) stamped with the database time. The event id
-- makes it idempotent: a record retried after a lost connection cannot log twice.
INSERT INTO connector_lease_audit_log
    (event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id, connector_id,
     epoch, correlation_id, recorded_at)
VALUES (%(event_id)s, %(event)s, %(outcome)s, %(reason)s, %(entry_tenant_id)s,
        %(entry_logical_agent_id)s, %(entry_binding_id)s, %(entry_connector_id)s,
        %(entry_epoch)s, %(correlation_id)s, clock_timestamp() + %(offset)s::interval)
ON CONFLICT (event_id) DO NOTHING
