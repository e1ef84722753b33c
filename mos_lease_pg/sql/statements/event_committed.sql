-- Whether one write took effect: a write and its audit row commit together, and the row
-- carries the write's outcome. A refusal's row reuses the event id of the write it refused,
-- with outcome 'denied': it is found although the write never happened, so only a row with
-- any other outcome answers yes (mos_lease.reconciliation.took_effect states the same rule).
-- Every partition of the log has an index on event_id (migration 0009).
SELECT EXISTS (SELECT 1 FROM {schema}.connector_lease_audit_log
               WHERE event_id = %(event_id)s AND outcome <> 'denied')
