-- 0008: a renewal passes the lease table's guard through a short WHEN clause.
--
-- PostgreSQL keeps a row trigger's WHEN clause as stored text and reads and compiles it
-- again for every execution of a statement that fires the trigger (the compiled form lives
-- in the executor state of that one execution; a prepared statement does not keep it). The
-- size of the clause is therefore paid by every single heartbeat. 0006's clause (0007's
-- since), three shapes of write in one, cost about 8% of a heartbeat's throughput against 0002's
-- renewal-only clause (the heartbeat statement on two copies of the schema differing only
-- in this trigger, interleaved on one connection).
--
-- The guard is split by the columns a write names (`UPDATE OF`: a column-specific trigger
-- fires when its UPDATE lists one of the columns as a target, and no other trigger on this
-- table changes a row, so a column the UPDATE does not list keeps its old value):
--
-- * `logical_agent_connector_leases_fencing` fires for every UPDATE that names an
--   identity, the lease UUID, the epoch, the connector, the scopes, acquired_at,
--   released_at or the holder metadata: a takeover, a release, or anything else that would
--   change whose lease the row is. Its clause is 0007's release and takeover branches;
-- * `logical_agent_connector_leases_times` fires for every UPDATE that names heartbeat_at,
--   expires_at or updated_at (every write the library makes names updated_at). A renewal
--   names no column of the first list, so its identity, lease UUID, epoch, connector,
--   scopes, acquired_at and released_at are the row's own: the clause checks only what a
--   renewal moves (0002's renewal clause without the comparisons that are then true). A
--   write that moved the epoch or released_at passed the first trigger (or was refused by
--   it), which judged its whole shape; this one bounds its updated_at by the clock.
--
-- Both still run the full check, mos_lease_check_lease_write(), for anything their clause
-- does not pass, so nothing the full check refuses passes either. 0005's trigger (stamps
-- never earlier than the row's) fires for every UPDATE as before. A renewal now reads one
-- short clause; a takeover and a release read both.
DROP TRIGGER logical_agent_connector_leases_fencing ON logical_agent_connector_leases;

CREATE TRIGGER logical_agent_connector_leases_fencing
    BEFORE UPDATE OF tenant_id, logical_agent_id, binding_id, lease_id, epoch, connector_id,
                     allowed_scopes, acquired_at, released_at, holder_metadata
    ON logical_agent_connector_leases
    FOR EACH ROW
    WHEN (NOT coalesce(
              NEW.tenant_id = OLD.tenant_id
              AND NEW.logical_agent_id = OLD.logical_agent_id
              AND NEW.binding_id = OLD.binding_id
              AND NEW.updated_at >= OLD.updated_at
              AND NEW.updated_at <= clock_timestamp()
              AND (
                  -- a release: only released_at and updated_at move, to the same time
                  (NEW.lease_id = OLD.lease_id
                   AND NEW.epoch = OLD.epoch
                   AND NEW.connector_id = OLD.connector_id
                   AND NEW.allowed_scopes = OLD.allowed_scopes
                   AND NEW.acquired_at = OLD.acquired_at
                   AND NEW.heartbeat_at = OLD.heartbeat_at
                   AND NEW.expires_at = OLD.expires_at
                   AND NEW.holder_metadata = OLD.holder_metadata
                   AND OLD.released_at IS NULL
                   AND NEW.released_at = NEW.updated_at)
                  -- a takeover: epoch + 1, a new lease UUID, stamped with one time
                  OR (NEW.epoch > OLD.epoch
                      AND NEW.epoch - 1 = OLD.epoch
                      AND NEW.lease_id <> OLD.lease_id
                      AND NEW.released_at IS NULL
                      AND NEW.acquired_at <> OLD.acquired_at
                      AND NEW.acquired_at = NEW.heartbeat_at
                      AND NEW.expires_at > NEW.heartbeat_at
                      AND NEW.expires_at <= NEW.heartbeat_at + interval '5 minutes'
                      AND NEW.updated_at >= NEW.heartbeat_at)), false))
    EXECUTE FUNCTION mos_lease_check_lease_write();

CREATE TRIGGER logical_agent_connector_leases_times
    BEFORE UPDATE OF heartbeat_at, expires_at, updated_at
    ON logical_agent_connector_leases
    FOR EACH ROW
    WHEN (NOT coalesce(
              NEW.updated_at <= clock_timestamp()
              AND (
                  -- a renewal (what it moves)
                  (OLD.released_at IS NULL
                   AND NEW.released_at IS NULL
                   AND NEW.expires_at > NEW.heartbeat_at
                   AND NEW.expires_at <= NEW.heartbeat_at + interval '5 minutes'
                   AND NEW.updated_at >= NEW.heartbeat_at)
                  -- a takeover or a release, judged whole by the trigger above
                  OR NEW.epoch <> OLD.epoch
                  OR (OLD.released_at IS NULL AND NEW.released_at IS NOT NULL)), false))
    EXECUTE FUNCTION mos_lease_check_lease_write();
