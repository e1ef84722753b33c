-- The start of the current month (UTC) by the database clock: the latest cutoff allowed.
SELECT date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
