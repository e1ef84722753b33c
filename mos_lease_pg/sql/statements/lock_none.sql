-- The lock step of an insert (see guarded_write.sql): nothing to lock, the row does not
-- exist yet.
    SELECT 1 WHERE false
