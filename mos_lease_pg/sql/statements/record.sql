-- One audit row (a refusal or a grant issue) stamped with the database time. Returns how many
-- rows it inserted: 0 means the event id was already taken, and the store then checks that
-- the row holding it is this same record (record_matches.sql): a record resent after a lost
-- connection must not log twice, and an attempt whose id another row holds is a bug that is
-- raised, never a row silently dropped. The function (migration 0004) serializes on the
-- event id and looks before inserting; the log's claim trigger refuses a duplicate anyway.
-- The stamp is the database clock read here (a test double adds its offset), and the log's
-- stamp check holds it to this statement's run.
SELECT {schema}.mos_lease_record_audit(
    '{schema}.connector_lease_audit_log'::regclass,
    %(event_id)s::uuid, %(event)s::text, %(outcome)s::text, %(reason)s::text,
    %(entry_tenant_id)s::text, %(entry_logical_agent_id)s::text, %(entry_binding_id)s::text,
    %(entry_connector_id)s::text, %(entry_epoch)s::bigint, %(correlation_id)s::text,
    clock_timestamp() + %(offset)s::interval)
