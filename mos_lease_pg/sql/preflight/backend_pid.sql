-- Which backend answers: behind a pooler that shares server sessions, not the one the
-- connection's startup named. Sent unprepared: there a prepared statement may collide.
SELECT pg_backend_pid()
