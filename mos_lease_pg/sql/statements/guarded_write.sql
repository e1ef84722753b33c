-- The envelope of every lease write: one statement, one round trip, one transaction.
--
-- `t` reads the database clock once; the write below is judged and stamped with that time,
-- and so is its audit row. The audit row is inserted from the write's RETURNING, so it
-- exists exactly when the write changed the row. The final SELECT always returns one row:
-- the time, plus the new lease columns if the guard held (NULLs if it did not).
--
-- {write} is one of insert.sql, renew.sql, close.sql, rotate.sql; it refers to `t` and to
-- the lease table as `l`. The audit epoch is cast to bigint only in a row actually inserted
-- (the CASE keeps the planner from folding the cast of a constant): a refused takeover at
-- the bigint maximum names epoch max + 1, which must not fail the statement.
WITH t AS (SELECT clock_timestamp() + %(offset)s::interval AS now),
written AS (
{write}
    RETURNING l.lease_id, l.connector_id, l.allowed_scopes, l.epoch, l.acquired_at,
              l.heartbeat_at, l.expires_at, l.released_at, l.updated_at
),
audited AS (
    INSERT INTO connector_lease_audit_log
        (event_id, event, outcome, reason, tenant_id, logical_agent_id, binding_id,
         connector_id, epoch, correlation_id, recorded_at)
    SELECT %(event_id)s, %(event)s, %(outcome)s, %(reason)s, %(entry_tenant_id)s,
           %(entry_logical_agent_id)s, %(entry_binding_id)s, %(entry_connector_id)s,
           CASE WHEN w.epoch IS NOT NULL THEN %(entry_epoch)s::numeric END,
           %(correlation_id)s, t.now
    FROM written AS w, t
)
SELECT t.now, w.lease_id, w.connector_id, w.allowed_scopes, w.epoch, w.acquired_at,
       w.heartbeat_at, w.expires_at, w.released_at, w.updated_at
FROM t LEFT JOIN written AS w ON true
