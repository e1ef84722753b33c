-- The monthly partitions missing through %(ahead)s months after the current one (0003).
SELECT * FROM {schema}.mos_lease_audit_partitions('{schema}.connector_lease_audit_log'::regclass,
                                                  %(ahead)s)
