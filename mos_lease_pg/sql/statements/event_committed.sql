-- Whether one write's audit row exists: a write and its audit row commit together. Every
-- partition of the log has an index on event_id (migration 0009).
SELECT EXISTS (SELECT 1 FROM {schema}.connector_lease_audit_log WHERE event_id = %(event_id)s)
