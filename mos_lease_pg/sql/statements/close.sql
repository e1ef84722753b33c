-- Release: the same full match as a heartbeat; keeps the epoch and stamps released_at.
    UPDATE {schema}.logical_agent_connector_leases AS l
    SET released_at = t.now, updated_at = t.now
    FROM t
    {active_holder}
