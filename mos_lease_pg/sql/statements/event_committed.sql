-- Whether one write's audit row exists: a write and its audit row commit together, and every
-- audit row claims its event id (migration 0004).
SELECT EXISTS (SELECT 1 FROM {schema}.connector_lease_event_ids WHERE event_id = %(event_id)s)
