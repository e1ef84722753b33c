-- Batched takeover: many compare-and-sets in one statement, one round trip and one commit.
--
-- Each request row is one takeover of a distinct identity, guarded by takeover_guard.sql
-- as rotate.sql is, with the request row's columns for values: its own expected epoch,
-- preemption flag and new lease UUID (made by the caller before the write, so a lost reply
-- is reconciled by it). Each takeover that applies gets its own audit row (audit_many.sql,
-- from the UPDATE's RETURNING) and its own notice (notify_many.sql); one whose guard fails
-- is simply not applied and does not affect the others.
--
-- `locked` takes the row locks in identity order, so two batches sharing rows cannot
-- deadlock, and skips a row another transaction holds (SKIP LOCKED, as renew_many.sql
-- does: a fenced transaction of a long tool keeps its row FOR SHARE, and waiting for it
-- would hold back the whole batch). A skipped row is not judged, written or audited; the
-- final SELECT says so (`skipped`) and the caller reports it as not reached. Time is read
-- after the locks: `t` consumes `locked` completely before it reads the clock, and both are
-- MATERIALIZED (see guarded_write.sql for why that matters); the UPDATE only writes rows
-- `locked` holds, so it never waits.
--
-- The final SELECT returns one row per request, in request order: the time, the new lease
-- columns if taken over, the row as `locked` found it (names a refusal without a second
-- read), and whether the row exists but was skipped. Scopes and metadata come as one JSON
-- text per request (an array of arrays of different lengths is not a PostgreSQL array).
WITH req AS (
    SELECT *
    FROM unnest(%(tenant_ids)b::text[], %(logical_agent_ids)b::text[],
                %(binding_ids)b::text[], %(expected_epochs)b::bigint[],
                %(preempt_actives)b::boolean[], %(new_lease_ids)b::uuid[],
                %(connector_ids)b::text[], %(scopes)b::text[], %(ttls)b::interval[],
                %(metadata)b::text[], %(event_ids)b::uuid[], %(correlation_ids)b::text[])
        WITH ORDINALITY AS r(tenant_id, logical_agent_id, binding_id, expected_epoch,
                             preempt_active, new_lease_id, connector_id, scopes, ttl,
                             metadata, event_id, correlation_id, ord)
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
    SET lease_id = r.new_lease_id, epoch = l.epoch + 1, connector_id = r.connector_id,
        allowed_scopes = ARRAY(SELECT jsonb_array_elements_text(r.scopes::jsonb)),
        acquired_at = t.now, heartbeat_at = t.now, expires_at = t.now + r.ttl,
        released_at = NULL, updated_at = t.now, holder_metadata = r.metadata::jsonb
    FROM t, req AS r, locked AS k
    {takeover_guard}
{applied_many}
