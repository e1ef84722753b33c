-- Audit rows after a sequence number, optionally narrowed by tenant, agent and binding.
SELECT a.seq, a.event_id, a.event, a.outcome, a.reason, a.tenant_id, a.logical_agent_id,
       a.binding_id, a.connector_id, a.epoch, a.correlation_id, a.recorded_at
FROM {schema}.connector_lease_audit_log AS a
WHERE a.seq > %(after_seq)s
  AND (%(tenant_id)s::text IS NULL OR a.tenant_id = %(tenant_id)s)
  AND (%(logical_agent_id)s::text IS NULL OR a.logical_agent_id = %(logical_agent_id)s)
  AND (%(binding_id)s::text IS NULL OR a.binding_id = %(binding_id)s)
ORDER BY a.seq
LIMIT %(limit)s
