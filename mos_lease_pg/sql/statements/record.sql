-- One audit row (a refusal or a grant issue) stamped with the database time. Returns how many
-- rows it inserted: 0 means the event id was already taken, and the store then checks that
-- the row holding it is this same record (record_matches.sql): a record resent after a lost
-- connection must not log twice, and an attempt whose id another row holds is a bug that is
-- raised, never a row silently dropped.
WITH inserted AS (
    INSERT INTO {schema}.connector_lease_audit_log
        (event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id,
         connector_id, epoch, correlation_id, recorded_at)
    VALUES (%(event_id)s, %(event)s, %(outcome)s, %(reason)s, %(entry_tenant_id)s,
            %(entry_logical_agent_id)s, %(entry_binding_id)s, %(entry_connector_id)s,
            %(entry_epoch)s, %(correlation_id)s, clock_timestamp() + %(offset)s::interval)
    ON CONFLICT (event_id) DO NOTHING
    RETURNING 1
)
SELECT count(*) FROM inserted
