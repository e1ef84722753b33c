-- The audit rows of a batched acquire, takeover or release: one per write applied, from the
-- write's RETURNING (joined to its request for the event id and correlation id: a batch
-- names each identity once), stamped with the statement's time. The epoch is the row's
-- after the write: 1 for an acquire, the new epoch for a takeover, the kept one for a
-- release (the caller's audit entries are checked to say the same before it is sent).
    INSERT INTO {schema}.connector_lease_audit_log
        (event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id,
         connector_id, epoch, correlation_id, recorded_at)
    SELECT r.event_id, %(event)s, %(outcome)s, NULL, w.tenant_id, w.logical_agent_id,
           w.binding_id, w.connector_id, w.epoch, r.correlation_id, t.now
    FROM written AS w
    JOIN req AS r
        ON r.tenant_id = w.tenant_id AND r.logical_agent_id = w.logical_agent_id
       AND r.binding_id = w.binding_id
    CROSS JOIN t
