-- Waits until no other transaction holds or is queued ahead for this identity's row lock,
-- so that a write still in flight on a lost connection has committed or rolled back before
-- its audit row is looked for. Needs UPDATE privilege on (a column of) the lease table.
SELECT 1 FROM logical_agent_connector_leases
WHERE tenant_id = %(tenant_id)s
  AND logical_agent_id = %(logical_agent_id)s
  AND binding_id = %(binding_id)s
FOR UPDATE
