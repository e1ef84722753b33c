-- Several audit rows (refusals, grant issues) in one statement and one commit: record.sql
-- for the appends that overlap in time on one store (mos_lease_pg/coalesce.py). Each entry
-- goes through the same function as record.sql, in the order given, each stamped with the
-- database clock read as it is appended; one row per entry comes back, in that order, with
-- how many rows it inserted (0: its event id was already taken, and the store checks that
-- row with record_matches.sql as it does for record.sql). The entries arrive as parallel
-- arrays; the reasons and epochs may hold NULLs.
SELECT {schema}.mos_lease_record_audit(
    '{schema}.connector_lease_audit_log'::regclass,
    e.event_id, e.event, e.outcome, e.reason, e.tenant_id, e.logical_agent_id, e.binding_id,
    e.connector_id, e.epoch, e.correlation_id, clock_timestamp() + %(offset)s::interval)
FROM unnest(%(event_ids)s::uuid[], %(events)s::text[], %(outcomes)s::text[],
            %(reasons)s::text[], %(tenant_ids)s::text[], %(logical_agent_ids)s::text[],
            %(binding_ids)s::text[], %(connector_ids)s::text[], %(epochs)s::bigint[],
            %(correlation_ids)s::text[])
    WITH ORDINALITY AS e(event_id, event, outcome, reason, tenant_id, logical_agent_id,
                         binding_id, connector_id, epoch, correlation_id, ord)
ORDER BY e.ord
