-- The full match of heartbeat and release: the row of this identity, held by this connector
-- under this lease UUID and epoch, not released and not expired at database time, and not
-- stamped later than that time (machine.clock_refusal: the clock stepped back). Each
-- {column} is the value it must equal: a parameter of one write (renew.sql, close.sql) or a
-- column of a request row of a batch (renew_many.sql).
    WHERE l.tenant_id = {tenant_id}
      AND l.logical_agent_id = {logical_agent_id}
      AND l.binding_id = {binding_id}
      AND l.connector_id = {connector_id}
      AND l.lease_id = {lease_id}
      AND l.epoch = {epoch}
      AND l.released_at IS NULL
      AND l.expires_at > t.now
      AND l.updated_at <= t.now
