-- The end of a batched takeover or release (takeover_many.sql, release_many.sql), after its
-- guard: the UPDATE writes only rows `locked` holds, and returns each new row; then each
-- applied write's audit row (audit_many.sql), its notice (notify_many.sql) and the final
-- SELECT (found_many.sql).
      AND k.tenant_id = l.tenant_id
      AND k.logical_agent_id = l.logical_agent_id
      AND k.binding_id = l.binding_id
    RETURNING l.tenant_id, l.logical_agent_id, l.binding_id, l.lease_id, l.connector_id,
              l.allowed_scopes, l.epoch, l.acquired_at, l.heartbeat_at, l.expires_at,
              l.released_at, l.updated_at, l.holder_metadata
),
audited AS (
{audit_many}
),
notified AS MATERIALIZED (
{notify_many}
)
{found_many}
