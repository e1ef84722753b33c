-- One line per row: a fixed key order and a UTC timestamp, so the same rows always give the
-- same bytes.
SELECT json_build_object(
    'seq', a.seq, 'event_id', a.event_id, 'event', a.event, 'outcome', a.outcome,
    'reason', a.reason, 'tenant_id', a.tenant_id, 'logical_agent_id', a.logical_agent_id,
    'binding_id', a.binding_id, 'connector_id', a.connector_id, 'epoch', a.epoch,
    'correlation_id', a.correlation_id,
    'recorded_at', to_char(a.recorded_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
)::text
FROM ONLY {schema}.{partition} AS a
ORDER BY a.seq
