-- What `mos-lease check` reads about the server and the session, in one round trip. Only
-- settings and functions every role may read, so it never fails for lack of a grant. The
-- settings are the ones this connection sees, role and database defaults included: a store
-- connecting as the same role sees the same (plus any startup options it sends).
SELECT current_setting('server_version_num')::int,
       current_setting('server_version'),
       current_user::text,
       current_database()::text,
       current_setting('synchronous_commit'),
       current_setting('synchronous_standby_names'),
       pg_is_in_recovery(),
       current_setting('statement_timeout'),
       current_setting('lock_timeout'),
       inet_server_port(),
       pg_backend_pid()
