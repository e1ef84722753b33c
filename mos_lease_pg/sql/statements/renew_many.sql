-- Batched heartbeat: many renewals in one statement, one round trip and one commit.
--
-- Each lease is matched on its full key and guarded by active_holder.sql, as in renew.sql,
-- with the request row's columns for values, and audited by
-- its own row (inserted from the UPDATE's RETURNING, so it exists exactly when that lease was
-- renewed). A lease whose guard fails is simply not renewed: it is not an error and does
-- not affect the others. `locked` takes the row locks in identity order (LockRows sits
-- above the sort), so two batches sharing leases cannot deadlock, and it skips a row another
-- transaction holds (SKIP LOCKED: a fenced_transaction keeps its lease row FOR SHARE while
-- a long tool runs): waiting for it would hold back every other lease of the batch until
-- the lock went or lock_timeout failed the whole statement. A skipped row is not judged,
-- not written and not audited; the final SELECT says so (`skipped`), and the caller tries
-- that lease again later, as after any transient failure. Time is read after the locks:
-- `t` consumes `locked` completely (count(*)) before it reads the clock, and both are
-- MATERIALIZED, so no renewal is judged by a time read before a lock wait (see
-- guarded_write.sql for why that matters; SKIP LOCKED never waits, and the UPDATE only
-- writes rows `locked` holds, so it never waits either). The final SELECT returns one row
-- per request, in request order: the time, the new lease columns if renewed, and whether
-- the row exists but was skipped (a row that does not exist is a failed guard, as in
-- renew.sql; the existence check runs only for a request whose row was not locked).
-- {audit} is audit_renewals.sql, or audit_none.sql when successful heartbeats are not
-- audited.
--
-- The arrays are sent in binary (`%(name)b`): in text format psycopg quotes every element,
-- which took about a quarter of the client's time for a batch of 1,000 leases.
WITH req AS (
    SELECT *
    FROM unnest(%(tenant_ids)b::text[], %(logical_agent_ids)b::text[],
                %(binding_ids)b::text[], %(connector_ids)b::text[], %(lease_ids)b::uuid[],
                %(epochs)b::bigint[], %(ttls)b::interval[], %(event_ids)b::uuid[],
                %(correlation_ids)b::text[])
        WITH ORDINALITY AS r(tenant_id, logical_agent_id, binding_id, connector_id, lease_id,
                             epoch, ttl, event_id, correlation_id, ord)
),
locked AS MATERIALIZED (
    SELECT l.tenant_id, l.logical_agent_id, l.binding_id
    FROM {schema}.logical_agent_connector_leases AS l
    WHERE (l.tenant_id, l.logical_agent_id, l.binding_id) IN
          (SELECT r.tenant_id, r.logical_agent_id, r.binding_id FROM req AS r)
    ORDER BY l.tenant_id, l.logical_agent_id, l.binding_id
    FOR UPDATE SKIP LOCKED
),
t AS MATERIALIZED (
    SELECT clock_timestamp() + %(offset)s::interval AS now
    FROM (SELECT count(*) FROM locked) AS held
),
written AS (
    UPDATE {schema}.logical_agent_connector_leases AS l
    SET heartbeat_at = t.now, expires_at = t.now + r.ttl, updated_at = t.now
    FROM t, req AS r, locked AS k
    {active_holder}
      AND k.tenant_id = l.tenant_id
      AND k.logical_agent_id = l.logical_agent_id
      AND k.binding_id = l.binding_id
    RETURNING r.ord, r.event_id, r.correlation_id, l.tenant_id, l.logical_agent_id,
              l.binding_id, l.lease_id, l.connector_id, l.allowed_scopes, l.epoch,
              l.acquired_at, l.heartbeat_at, l.expires_at, l.released_at, l.updated_at,
              l.holder_metadata
),
audited AS (
{audit}
)
SELECT t.now, w.lease_id, w.connector_id, w.allowed_scopes, w.epoch, w.acquired_at,
       w.heartbeat_at, w.expires_at, w.released_at, w.updated_at,
       NULLIF(w.holder_metadata, '{}'::jsonb),
       k.tenant_id IS NULL AND EXISTS (
           SELECT FROM {schema}.logical_agent_connector_leases AS s
           WHERE s.tenant_id = r.tenant_id AND s.logical_agent_id = r.logical_agent_id
             AND s.binding_id = r.binding_id) AS skipped
FROM t CROSS JOIN req AS r LEFT JOIN written AS w ON w.ord = r.ord
LEFT JOIN locked AS k ON k.tenant_id = r.tenant_id AND k.logical_agent_id = r.logical_agent_id
                     AND k.binding_id = r.binding_id
ORDER BY r.ord
