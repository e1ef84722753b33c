-- For reconciling an event this process does not remember (it knows no backend to end): how
-- many other backends of this role in this database are still inside a transaction that
-- began no later than `since` (NULL: now, returned for the next poll). Every write is one
-- statement, so a write that reached the server before reconcile began is one of them until
-- it has committed or rolled back.
SELECT s.since, count(a.pid)
FROM (SELECT coalesce(%(since)s::timestamptz, clock_timestamp()) AS since) AS s
LEFT JOIN pg_stat_activity AS a
  ON a.usename = current_user
 AND a.datname = current_database()
 AND a.pid <> pg_backend_pid()
 AND a.state <> 'idle'
 AND a.xact_start <= s.since
GROUP BY s.since
