-- One audit row (a refusal or a grant issue) stamped with the database time. Returns how many
-- rows it inserted: 0 means the event id was already taken, and the store then checks that
-- the row holding it is this same record (record_matches.sql): a record resent after a lost
-- connection must not log twice, and an attempt whose id another row holds is a bug that is
-- raised, never a row silently dropped. The function (migration 0011: record_many.sql's, with
-- one entry) serializes on the event id and looks before inserting; the log's own guards
-- refuse a duplicate anyway. The stamp is the database clock read here (a test double adds
-- its offset), and the log's stamp check holds it to this statement's run.
SELECT r FROM {schema}.mos_lease_record_audit(
    ARRAY[%(event_id)s::uuid], ARRAY[%(event)s::text], ARRAY[%(outcome)s::text],
    ARRAY[%(reason)s::text], ARRAY[%(entry_tenant_id)s::text],
    ARRAY[%(entry_logical_agent_id)s::text], ARRAY[%(entry_binding_id)s::text],
    ARRAY[%(entry_connector_id)s::text], ARRAY[%(entry_epoch)s::bigint],
    ARRAY[%(correlation_id)s::text], clock_timestamp() + %(offset)s::interval) AS r
