-- After a record found its event id taken: whether the row holding it is this very record
-- (a resend after a lost connection, which must not log twice) rather than another attempt's
-- (a bug to surface, never to swallow).
SELECT EXISTS (
    SELECT 1
    FROM {schema}.connector_lease_audit_log AS a
    WHERE a.event_id = %(event_id)s
      AND a.event = %(event)s
      AND a.outcome = %(outcome)s
      AND a.reason IS NOT DISTINCT FROM %(reason)s::text
      AND a.tenant_id = %(entry_tenant_id)s
      AND a.logical_agent_id = %(entry_logical_agent_id)s
      AND a.binding_id = %(entry_binding_id)s
      AND a.connector_id = %(entry_connector_id)s
      AND a.epoch IS NOT DISTINCT FROM %(entry_epoch)s::bigint
      AND a.correlation_id = %(correlation_id)s
)
