-- The envelope of every lease write: one statement, one round trip, one transaction.
--
-- Time is read after the lock. `locked` takes this identity's row lock first ({lock} is
-- lock_row.sql: FOR UPDATE, the strongest row lock, so no later step of this statement waits
-- for another session). `t` reads the database clock once, and only after `locked` has run:
-- its FROM clause consumes `locked` completely (count(*)), and both CTEs are MATERIALIZED,
-- so PostgreSQL can neither inline nor reorder them. A clock read before a lock wait would
-- be stale by the length of the wait, and READ COMMITTED re-checks the write's WHERE on the
-- newest row version but with that stale time: a heartbeat that waited past the lease's
-- expiry would renew a lease another session had already seen expire.
--
-- An insert locks nothing ({lock} is lock_none.sql): it writes only where no row exists, so
-- nobody can have observed the row it creates, and an acquire of an existing identity must
-- stay a no-op that never waits behind a lock holder (ON CONFLICT DO NOTHING takes no lock).
--
-- The write is judged and stamped with that time, and so is its audit row. The audit row is
-- inserted from the write's RETURNING, so it exists exactly when the write changed the row.
-- The final SELECT always returns one row: the time, the new lease columns if the guard held
-- (NULLs if it did not), and the locked row as the write found it (NULLs if there was none),
-- from which a refused write's reason is named.
--
-- {write} is one of insert.sql, renew.sql, close.sql, rotate.sql; it refers to `t` and to
-- the lease table as `l`. The audit epoch is cast to bigint only in a row actually inserted
-- (the CASE keeps the planner from folding the cast of a constant): a refused takeover at
-- the bigint maximum names epoch max + 1, which must not fail the statement.
--
-- {audit} is audit_write.sql, or audit_none.sql for a heartbeat of a store that does not
-- audit successful heartbeats (ConnectionSettings.audit_heartbeats).
--
-- {notify} is notify.sql for a takeover or a release and notify_none.sql otherwise. A CTE
-- that only reads runs only when referenced: the final SELECT counts its rows, so the
-- pg_notify calls in it really happen (within this statement, so within its transaction).
WITH locked AS MATERIALIZED (
{lock}
),
t AS MATERIALIZED (
    SELECT clock_timestamp() + %(offset)s::interval AS now
    FROM (SELECT count(*) FROM locked) AS held
),
written AS (
{write}
    RETURNING l.lease_id, l.connector_id, l.allowed_scopes, l.epoch, l.acquired_at,
              l.heartbeat_at, l.expires_at, l.released_at, l.updated_at, l.holder_metadata
),
audited AS (
{audit}
),
notified AS MATERIALIZED (
{notify}
)
SELECT t.now, w.lease_id, w.connector_id, w.allowed_scopes, w.epoch, w.acquired_at,
       w.heartbeat_at, w.expires_at, w.released_at, w.updated_at,
       NULLIF(w.holder_metadata, '{}'::jsonb),
       k.lease_id, k.connector_id, k.allowed_scopes, k.epoch, k.acquired_at,
       k.heartbeat_at, k.expires_at, k.released_at, k.updated_at,
       NULLIF(k.holder_metadata, '{}'::jsonb)
FROM t LEFT JOIN written AS w ON true LEFT JOIN locked AS k ON true
CROSS JOIN (SELECT count(*) FROM notified) AS sent
