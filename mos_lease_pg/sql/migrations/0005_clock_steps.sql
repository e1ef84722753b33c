-- 0005: a lease row's stamps never run backwards, for every role.
--
-- Every write of a lease row stamps updated_at with the database clock read once it holds
-- the row, and no other stamp of a row is later than updated_at (0002). If that clock
-- steps back (a failover to a host whose clock is behind, a bad NTP step), a write judged at
-- the earlier time could renew a lease that another session already saw expire. The
-- library's writes refuse themselves in that case (their guard requires updated_at <= the
-- write's time, and the store names the refusal `clock_behind`); this trigger refuses the
-- same for any other UPDATE, by any role, as 0002 does for the shape of a write.
--
-- What this detects, and what not: a step back is seen by a row only while the clock reads
-- earlier than that row's own latest stamp. A step back shorter than the time since the
-- row's last write leaves the clock after that stamp, and nothing here can tell it from an
-- ordinary write (`mos-lease check` compares the clock with the newest stamp of all rows).
--
-- Cost: a WHEN clause only (one timestamp comparison per updated row, no function call on
-- the path of a legal write).
CREATE TRIGGER logical_agent_connector_leases_stamps_forward
    BEFORE UPDATE ON logical_agent_connector_leases
    FOR EACH ROW
    WHEN (NOT coalesce(NEW.updated_at >= OLD.updated_at, false))
    EXECUTE FUNCTION mos_lease_refuse(
        'a lease row is never stamped earlier than its latest stamp (the database clock '
        'stepped back)');
