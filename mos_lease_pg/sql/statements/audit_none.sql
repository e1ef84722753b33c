-- No audit row: a successful heartbeat of a store with audit_heartbeats=False (a denied
-- heartbeat is still recorded, by record.sql). A CTE that only reads runs only when
-- referenced, and nothing references this one.
    SELECT WHERE false
