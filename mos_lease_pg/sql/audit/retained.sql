-- Retention has passed %(boundary)s: no audit row may be appended before it any more, and
-- the event-id claims of the rows archived leave with them (migration 0004).
SELECT {schema}.mos_lease_audit_retained('{schema}.connector_lease_audit_log'::regclass,
                                         %(boundary)s::timestamptz)
