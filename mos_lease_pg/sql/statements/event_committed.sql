-- Whether the audit row of one write exists: a write and its audit row commit together.
SELECT EXISTS (SELECT 1 FROM {schema}.connector_lease_audit_log WHERE event_id = %(event_id)s)
