-- Batched release: many releases in one statement, one round trip and one commit.
--
-- Each request row is one release of a distinct identity, matched on its full key and
-- guarded by active_holder.sql as close.sql is, with the request row's columns for values;
-- it keeps the epoch and stamps released_at. Each release that applies gets its own audit
-- row (audit_many.sql) and its own notice (notify_many.sql); one whose guard fails is simply
-- not applied and does not affect the others. Locks, skipped rows, the time and the final
-- SELECT are as in takeover_many.sql.
WITH req AS (
    SELECT *
    FROM unnest(%(tenant_ids)b::text[], %(logical_agent_ids)b::text[],
                %(binding_ids)b::text[], %(connector_ids)b::text[], %(lease_ids)b::uuid[],
                %(epochs)b::bigint[], %(event_ids)b::uuid[], %(correlation_ids)b::text[])
        WITH ORDINALITY AS r(tenant_id, logical_agent_id, binding_id, connector_id, lease_id,
                             epoch, event_id, correlation_id, ord)
),
locked AS MATERIALIZED (
{lock_many}
),
t AS MATERIALIZED (
    SELECT clock_timestamp() + %(offset)s::interval AS now
    FROM (SELECT count(*) FROM locked) AS held
),
written AS (
    UPDATE {schema}.logical_agent_connector_leases AS l
    SET released_at = t.now, updated_at = t.now
    FROM t, req AS r, locked AS k
    {active_holder}
{applied_many}
