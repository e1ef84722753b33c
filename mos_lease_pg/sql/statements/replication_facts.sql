-- What the first-use check reads of replication (replication.py): one round trip, no
-- privilege needed, since every role may read these settings.
SELECT NOT pg_is_in_recovery(), current_setting('synchronous_commit'),
       current_setting('synchronous_standby_names')
