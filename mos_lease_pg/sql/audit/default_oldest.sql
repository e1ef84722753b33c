-- The oldest row the DEFAULT partition caught (rows outside every monthly partition).
SELECT min(recorded_at) FROM ONLY {schema}.connector_lease_audit_log_default
