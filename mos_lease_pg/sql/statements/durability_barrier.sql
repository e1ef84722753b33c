-- A commit that waits for the synchronous standby (replication.py): set_config(..., true)
-- lasts for this statement's transaction only, so whatever the role's synchronous_commit,
-- this commit waits; once it returns, every earlier commit is on the standby too.
SELECT set_config('synchronous_commit', 'on', true),
       pg_logical_emit_message(true, 'mos-lease', ''),
       current_setting('synchronous_standby_names')
