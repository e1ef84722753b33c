-- Whether that backend still exists. A backend aborts its transaction before it leaves
-- pg_stat_activity, so once it is gone its write has committed or rolled back for good.
-- Each poll is its own transaction: pg_stat_activity is a snapshot per transaction.
SELECT EXISTS (
    SELECT 1 FROM pg_stat_activity AS a
    WHERE a.pid = %(pid)s AND a.usename = current_user AND a.datname = current_database()
)
