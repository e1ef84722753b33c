-- No notice: acquire and heartbeat change nobody's view of who holds the lease.
    SELECT WHERE false
