-- Ends the backend that was running a write whose connection was lost, so that the write can
-- no longer commit: a write lost while queued behind a lock (on its row, on the audit table,
-- anywhere) would otherwise commit after its audit row was looked for. Only a backend of this
-- role in this database, never our own: a role may signal its own backends. A backend that
-- already ended is simply not found. Returns how many backends were signalled (0 or 1).
SELECT count(pg_terminate_backend(a.pid))
FROM pg_stat_activity AS a
WHERE a.pid = %(pid)s
  AND a.usename = current_user
  AND a.datname = current_database()
  AND a.pid <> pg_backend_pid()
