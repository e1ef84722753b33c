-- One reading of the database clock for the offset measurement, and the backend that
-- answered (a transaction pooler hands successive transactions to different backends).
SELECT clock_timestamp(), pg_backend_pid()
