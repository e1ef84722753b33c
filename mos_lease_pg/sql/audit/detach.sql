ALTER TABLE {schema}.connector_lease_audit_log DETACH PARTITION {schema}.{partition}
