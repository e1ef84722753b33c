-- Several audit rows (refusals, grant issues) in one statement and one commit: record.sql
-- for the appends that overlap in time on one store (mos_lease_pg/coalesce.py). The set form
-- of the record function (migration 0011) appends them all at once, each as record.sql
-- appends it: locked on its event id, appended unless a row (or an earlier entry of the
-- batch) holds that id, stamped with the database clock read here. One row per entry comes
-- back, in the order given, with how many rows it inserted (0: its event id was already
-- taken, and the store checks that row with record_matches.sql as it does for record.sql).
-- The entries arrive as parallel arrays; the reasons and epochs may hold NULLs.
SELECT r FROM {schema}.mos_lease_record_audit(
    %(event_ids)s::uuid[], %(events)s::text[], %(outcomes)s::text[], %(reasons)s::text[],
    %(tenant_ids)s::text[], %(logical_agent_ids)s::text[], %(binding_ids)s::text[],
    %(connector_ids)s::text[], %(epochs)s::bigint[], %(correlation_ids)s::text[],
    clock_timestamp() + %(offset)s::interval) AS r
