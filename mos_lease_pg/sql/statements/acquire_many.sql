-- Batched first acquisition: many insert-only creations at epoch 1 in one statement, one
-- round trip and one commit.
--
-- Each request row is one identity (distinct within a batch); an existing row, in any
-- state, makes that one a no-op, as in insert.sql, and does not affect the others. An
-- insert locks nothing (see guarded_write.sql: nobody can have observed the row it creates,
-- and an acquire of an existing identity never waits behind a lock holder). The rows are
-- inserted in identity order, so two batches inserting the same new identities wait for
-- each other in one order and cannot deadlock. Each row inserted gets its own audit row
-- (audit_many.sql). The final SELECT returns one row per request, in request order: the
-- time, plus the new lease columns if inserted. Scopes and metadata come as JSON text, as
-- in takeover_many.sql.
WITH req AS (
    SELECT *
    FROM unnest(%(tenant_ids)b::text[], %(logical_agent_ids)b::text[],
                %(binding_ids)b::text[], %(lease_ids)b::uuid[], %(connector_ids)b::text[],
                %(scopes)b::text[], %(ttls)b::interval[], %(metadata)b::text[],
                %(event_ids)b::uuid[], %(correlation_ids)b::text[])
        WITH ORDINALITY AS r(tenant_id, logical_agent_id, binding_id, lease_id, connector_id,
                             scopes, ttl, metadata, event_id, correlation_id, ord)
),
t AS MATERIALIZED (
    SELECT clock_timestamp() + %(offset)s::interval AS now
),
written AS (
    INSERT INTO {schema}.logical_agent_connector_leases AS l
        (tenant_id, logical_agent_id, binding_id, lease_id, connector_id, allowed_scopes,
         epoch, acquired_at, heartbeat_at, expires_at, released_at, updated_at,
         holder_metadata)
    SELECT r.tenant_id, r.logical_agent_id, r.binding_id, r.lease_id, r.connector_id,
           ARRAY(SELECT jsonb_array_elements_text(r.scopes::jsonb)), 1, t.now, t.now,
           t.now + r.ttl, NULL, t.now, r.metadata::jsonb
    FROM t CROSS JOIN req AS r
    ORDER BY r.tenant_id, r.logical_agent_id, r.binding_id
    ON CONFLICT (tenant_id, logical_agent_id, binding_id) DO NOTHING
    RETURNING l.tenant_id, l.logical_agent_id, l.binding_id, l.lease_id, l.connector_id,
              l.allowed_scopes, l.epoch, l.acquired_at, l.heartbeat_at, l.expires_at,
              l.released_at, l.updated_at, l.holder_metadata
),
audited AS (
{audit_many}
)
SELECT t.now, w.lease_id, w.connector_id, w.allowed_scopes, w.epoch, w.acquired_at,
       w.heartbeat_at, w.expires_at, w.released_at, w.updated_at,
       NULLIF(w.holder_metadata, '{}'::jsonb)
FROM t CROSS JOIN req AS r
LEFT JOIN written AS w
    ON w.tenant_id = r.tenant_id AND w.logical_agent_id = r.logical_agent_id
   AND w.binding_id = r.binding_id
ORDER BY r.ord
