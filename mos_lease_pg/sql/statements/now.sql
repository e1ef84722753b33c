-- The database time (plus the test-only offset).
SELECT clock_timestamp() + %(offset)s::interval
