-- 0006: every legal write of the library passes the lease table's guard without a function
-- call, not only a renewal.
--
-- 0002's guard (logical_agent_connector_leases_fencing) runs the full check,
-- mos_lease_check_lease_write(), for every UPDATE its WHEN clause does not pass, and that
-- clause passed renewals only. So every takeover and every release of the library paid a
-- PL/pgSQL call with a dynamic statement (the settings read), measured at about a quarter of
-- a takeover's server time. The clause below passes, besides a renewal, exactly a takeover
-- and a release of the shape the library writes, stamped by the database clock; any other
-- UPDATE (a test clock offset, a hand-made write, a hostile one) still runs the full check,
-- which keeps refusing what it refused. Nothing the full check refuses passes here: each
-- branch is a conjunction of that check's own conditions for its kind of write (tightened
-- where the library's writes allow it: a takeover stamps acquired_at = heartbeat_at, a
-- release stamps released_at = updated_at and moves no other stamp), with every stamp bound
-- finite by a comparison with a finite one, and updated_at never earlier than the row's
-- (0005's trigger, unchanged, refuses that on every path as before).
DROP TRIGGER logical_agent_connector_leases_fencing ON logical_agent_connector_leases;

CREATE TRIGGER logical_agent_connector_leases_fencing
    BEFORE UPDATE ON logical_agent_connector_leases
    FOR EACH ROW
    WHEN (NOT coalesce(
              NEW.tenant_id = OLD.tenant_id
              AND NEW.logical_agent_id = OLD.logical_agent_id
              AND NEW.binding_id = OLD.binding_id
              AND NEW.updated_at >= OLD.updated_at
              AND NEW.updated_at <= clock_timestamp()
              AND (
                  -- a renewal (0002's clause)
                  (NEW.lease_id = OLD.lease_id
                   AND NEW.epoch = OLD.epoch
                   AND NEW.connector_id = OLD.connector_id
                   AND NEW.allowed_scopes = OLD.allowed_scopes
                   AND NEW.acquired_at = OLD.acquired_at
                   AND OLD.released_at IS NULL
                   AND NEW.released_at IS NULL
                   AND NEW.expires_at > NEW.heartbeat_at
                   AND NEW.expires_at <= NEW.heartbeat_at + interval '5 minutes'
                   AND NEW.updated_at >= NEW.heartbeat_at)
                  -- a release: only released_at and updated_at move, to the same time
                  OR (NEW.lease_id = OLD.lease_id
                      AND NEW.epoch = OLD.epoch
                      AND NEW.connector_id = OLD.connector_id
                      AND NEW.allowed_scopes = OLD.allowed_scopes
                      AND NEW.acquired_at = OLD.acquired_at
                      AND NEW.heartbeat_at = OLD.heartbeat_at
                      AND NEW.expires_at = OLD.expires_at
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
