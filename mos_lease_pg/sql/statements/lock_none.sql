-- The lock step of an insert (see guarded_write.sql): nothing to lock, the row does not
-- exist yet. The same columns as lock_row.sql, so the final SELECT reads either; an insert
-- that found a row cannot see it in its snapshot, so it reports none (NULLs).
    SELECT NULL::uuid AS lease_id, NULL::text AS connector_id,
           NULL::text[] AS allowed_scopes, NULL::bigint AS epoch,
           NULL::timestamptz AS acquired_at, NULL::timestamptz AS heartbeat_at,
           NULL::timestamptz AS expires_at, NULL::timestamptz AS released_at,
           NULL::timestamptz AS updated_at, NULL::jsonb AS holder_metadata
    WHERE false
