-- 0011: the resendable audit record appends a whole batch in one set-based step.
--
-- 0004's mos_lease_record_audit appends one record per call, through two dynamic statements
-- (EXECUTE format: planned again on every call), about 0.2-0.3 ms of the database's time per
-- row; a coalesced batch of grants (record_many.sql) called it once per entry, so its audit
-- rows, not its commit, bounded the batch (32 entries: about 7-10 ms per statement).
--
-- Now a set form of the same function takes the batch as parallel arrays and appends it in
-- two static statements, planned once per session: it takes every entry's advisory lock
-- (0004's, one per event id, in one order for every caller so two batches sharing ids
-- cannot deadlock), then, in a statement that starts after the locks are held and so sees
-- every record committed before (READ COMMITTED: each statement of a function takes a new
-- snapshot), appends each entry whose event id no row holds, the first of its ids within
-- the batch, stamped with the stamp the caller read from the database clock. It returns, per
-- entry and in order, how many rows it inserted (0: the id was taken, by an earlier record
-- or an earlier entry of the same batch), exactly what a call of 0004's function per entry
-- returned. record.sql (one entry) and record_many.sql both call it.
--
-- Every guarantee of the log stays the log's own, whatever path appends: event ids once
-- (0009's CHECK, unique index and claims), stamps held to the clock (0004's trigger),
-- retention moving forward, append-only. Like 0004's function it runs with its caller's
-- privileges (it lets no one do more than INSERT into the log) and is executable by the
-- gateway role (roles.sql). The log it appends to is written into its body when it is
-- made (as 0004's claim): a static statement cannot name a table given as an argument.
--
-- 0004's one-record signature stays for callers of earlier versions and now appends through
-- the set form (one rule, written once); it refuses any log but this schema's.
--
-- Cost: measured by `bench/run.py --only coalesce` (coalesced_grant_*_vs_single).
DO $records$
DECLARE
    -- Already quoted where needed (see mos_lease_audit_guard in 0003).
    here text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                  WHERE c.oid = 'connector_lease_audit_log'::regclass);
BEGIN
    EXECUTE format($f$
        CREATE FUNCTION %1$s.mos_lease_record_audit(
            p_event_ids uuid[], p_events text[], p_outcomes text[], p_reasons text[],
            p_tenant_ids text[], p_logical_agent_ids text[], p_binding_ids text[],
            p_connector_ids text[], p_epochs bigint[], p_correlation_ids text[],
            p_recorded_at timestamptz) RETURNS SETOF integer
        LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            IF cardinality(p_event_ids) IS DISTINCT FROM cardinality(p_events)
               OR cardinality(p_event_ids) IS DISTINCT FROM cardinality(p_outcomes)
               OR cardinality(p_event_ids) IS DISTINCT FROM cardinality(p_reasons)
               OR cardinality(p_event_ids) IS DISTINCT FROM cardinality(p_tenant_ids)
               OR cardinality(p_event_ids) IS DISTINCT FROM cardinality(p_logical_agent_ids)
               OR cardinality(p_event_ids) IS DISTINCT FROM cardinality(p_binding_ids)
               OR cardinality(p_event_ids) IS DISTINCT FROM cardinality(p_connector_ids)
               OR cardinality(p_event_ids) IS DISTINCT FROM cardinality(p_epochs)
               OR cardinality(p_event_ids) IS DISTINCT FROM cardinality(p_correlation_ids)
            THEN
                -- unnest would pad the shorter arrays with NULLs: refused, nothing written.
                RAISE EXCEPTION 'mos-lease: the audit records'' arrays differ in length'
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            PERFORM pg_advisory_xact_lock(1836020588, k.h)
            FROM (SELECT DISTINCT hashtext(i.event_id::text) AS h
                  FROM unnest(p_event_ids) AS i(event_id) ORDER BY 1) AS k;
            RETURN QUERY
            WITH e AS MATERIALIZED (
                SELECT u.*,
                       NOT EXISTS (SELECT 1 FROM %1$s.connector_lease_audit_log AS a
                                   WHERE a.event_id = u.event_id)
                       AND u.ord = min(u.ord) OVER (PARTITION BY u.event_id) AS fresh
                FROM unnest(p_event_ids, p_events, p_outcomes, p_reasons, p_tenant_ids,
                            p_logical_agent_ids, p_binding_ids, p_connector_ids, p_epochs,
                            p_correlation_ids) WITH ORDINALITY
                    AS u(event_id, event, outcome, reason, tenant_id, logical_agent_id,
                         binding_id, connector_id, epoch, correlation_id, ord)
            ), appended AS (
                INSERT INTO %1$s.connector_lease_audit_log
                    (event_id, event, outcome, reason, tenant_id, logical_agent_id,
                     binding_id, connector_id, epoch, correlation_id, recorded_at)
                SELECT e.event_id, e.event, e.outcome, e.reason, e.tenant_id,
                       e.logical_agent_id, e.binding_id, e.connector_id, e.epoch,
                       e.correlation_id, p_recorded_at
                FROM e WHERE e.fresh ORDER BY e.ord
            )
            SELECT e.fresh::integer FROM e ORDER BY e.ord;
        END
        $body$$f$, here);

    -- 0004's signature, appending through the set form.
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION %1$s.mos_lease_record_audit(
            log regclass, p_event_id uuid, p_event text, p_outcome text, p_reason text,
            p_tenant_id text, p_logical_agent_id text, p_binding_id text,
            p_connector_id text, p_epoch bigint, p_correlation_id text,
            p_recorded_at timestamptz) RETURNS integer
        LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            IF log IS DISTINCT FROM %2$L::regclass THEN
                RAISE EXCEPTION 'mos-lease: records are appended to %%, not %%',
                    %2$L::regclass, log USING ERRCODE = 'invalid_parameter_value';
            END IF;
            RETURN (SELECT r FROM %1$s.mos_lease_record_audit(
                ARRAY[p_event_id], ARRAY[p_event], ARRAY[p_outcome], ARRAY[p_reason],
                ARRAY[p_tenant_id], ARRAY[p_logical_agent_id], ARRAY[p_binding_id],
                ARRAY[p_connector_id], ARRAY[p_epoch], ARRAY[p_correlation_id],
                p_recorded_at) AS r);
        END
        $body$$f$, here, format('%s.connector_lease_audit_log', here));
END
$records$;
