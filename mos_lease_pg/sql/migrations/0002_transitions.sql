-- 0002: the database permits only the library's transitions, for every role.
--
-- Privileges alone cannot do this: the gateway role must be able to UPDATE the epoch, the
-- lease UUID and the times (a takeover sets them all), so with privileges only it could also
-- set any epoch, any UUID, 'infinity'. Here every write of a lease row must have the shape
-- of one of the library's four transitions, checked by triggers that fire for every role,
-- the owner included (only a superuser can step around triggers, with
-- session_replication_role; the owner can still drop them on purpose, which is DDL):
--
--   insert   at epoch 1, unreleased, acquired_at = heartbeat_at = updated_at;
--   renew    only heartbeat_at, expires_at and updated_at change, on an unreleased row;
--   release  released_at set from NULL (and updated_at); nothing else changes;
--   rotate   epoch exactly + 1 together with a new lease UUID, freshly stamped
--            (acquired_at <= heartbeat_at), unreleased; connector and scopes may change.
--
-- Identity columns never change. Every stamp of a write is finite and no later than the
-- database clock (plus the allowance below), and expires_at lies after heartbeat_at by at
-- most the lease cap (5 minutes), so no role can make a lease outlive the cap. Resource
-- high-water marks never decrease and their identity never changes.
--
-- Cost: the checks are split so that a production heartbeat pays only a WHEN expression
-- (evaluated by the executor without calling any function); the function runs for the
-- other transitions and for anything that is not an obvious renewal. Measured in the
-- issue note (heartbeat throughput with and without these triggers, same run).

-- One owner-owned row of settings, read by the checking function (SECURITY DEFINER, so
-- the gateway role needs, and gets, no privilege on this table and cannot change it).
--
-- clock_allowance: how far ahead of the database clock a write may stamp its times. The
-- library stamps every write with the database clock read in the same statement, so in
-- production this stays 0. Test suites move the store's time forward with a test-only
-- offset; their databases raise it as a superuser or the owner. A missing row means 0.
CREATE TABLE mos_lease_settings (
    singleton        boolean  NOT NULL DEFAULT true,
    clock_allowance  interval NOT NULL DEFAULT interval '0',
    CONSTRAINT mos_lease_settings_pkey PRIMARY KEY (singleton),
    CONSTRAINT mos_lease_settings_singleton_check CHECK (singleton),
    CONSTRAINT mos_lease_settings_clock_allowance_check CHECK (clock_allowance >= interval '0')
);
INSERT INTO mos_lease_settings DEFAULT VALUES;

-- The functions of this schema run with a fixed search_path: nothing they do can be
-- redirected by the caller's (pg_temp last, so a temporary object never shadows).
ALTER FUNCTION mos_lease_refuse() SET search_path = pg_catalog, pg_temp;

-- The full check of a lease row write, for what the WHEN clauses below do not pass.
-- Tables are found through TG_TABLE_SCHEMA, never through a search_path, so the function
-- works in whatever schema the migration ran. Column NULLs are refused here too (NOT NULL
-- constraints are checked only after BEFORE triggers): every test is coalesced to false.
CREATE FUNCTION mos_lease_check_lease_write() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lease_cap CONSTANT interval := interval '5 minutes';
    stamped   boolean := false;  -- a write that sets heartbeat_at and expires_at
    why       text;
    allowance interval;
    latest    timestamptz;
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NOT coalesce(NEW.epoch = 1, false) THEN
            why := 'a lease row is created at epoch 1';
        ELSIF NEW.released_at IS NOT NULL THEN
            why := 'a lease row is created unreleased';
        ELSIF NOT coalesce(NEW.acquired_at = NEW.heartbeat_at
                           AND NEW.updated_at = NEW.heartbeat_at, false) THEN
            why := 'a new lease row is stamped with one time';
        ELSE
            stamped := true;
        END IF;
    ELSIF NEW.tenant_id IS DISTINCT FROM OLD.tenant_id
          OR NEW.logical_agent_id IS DISTINCT FROM OLD.logical_agent_id
          OR NEW.binding_id IS DISTINCT FROM OLD.binding_id THEN
        why := 'identities never change';
    ELSIF NOT coalesce(NEW.epoch >= OLD.epoch, false) THEN
        why := 'epochs never go backwards';
    ELSIF NEW.epoch = OLD.epoch THEN
        IF NEW.lease_id IS DISTINCT FROM OLD.lease_id THEN
            why := 'the lease UUID changes only with a takeover (epoch + 1)';
        ELSIF OLD.released_at IS NOT NULL THEN
            why := 'a released lease changes only by a takeover';
        ELSIF NEW.connector_id IS DISTINCT FROM OLD.connector_id
              OR NEW.allowed_scopes IS DISTINCT FROM OLD.allowed_scopes
              OR NEW.acquired_at IS DISTINCT FROM OLD.acquired_at THEN
            why := 'connector, scopes and acquired_at change only with a takeover';
        ELSIF NEW.released_at IS NULL THEN
            stamped := true;  -- a renewal
        ELSIF NEW.heartbeat_at IS DISTINCT FROM OLD.heartbeat_at
              OR NEW.expires_at IS DISTINCT FROM OLD.expires_at THEN
            why := 'a release changes only released_at and updated_at';
        ELSIF NOT coalesce(isfinite(NEW.released_at)
                           AND NEW.released_at <= NEW.updated_at, false) THEN
            why := 'released_at is finite and not after updated_at';
        END IF;
    ELSIF NEW.epoch - 1 <> OLD.epoch THEN
        why := 'an epoch rises by exactly one';
    ELSIF NOT coalesce(NEW.lease_id <> OLD.lease_id, false) THEN
        why := 'a takeover rotates the lease UUID';
    ELSIF NEW.released_at IS NOT NULL THEN
        why := 'a takeover leaves the lease unreleased';
    ELSIF NOT coalesce(NEW.acquired_at <> OLD.acquired_at
                       AND NEW.acquired_at <= NEW.heartbeat_at, false) THEN
        why := 'a takeover stamps a fresh acquired_at, not after heartbeat_at';
    ELSE
        stamped := true;
    END IF;

    IF why IS NULL AND stamped THEN
        IF NOT coalesce(isfinite(NEW.acquired_at) AND isfinite(NEW.heartbeat_at), false) THEN
            why := 'timestamps are finite';
        ELSIF NOT coalesce(NEW.expires_at > NEW.heartbeat_at
                           AND NEW.expires_at <= NEW.heartbeat_at + lease_cap, false) THEN
            why := 'expires_at lies after heartbeat_at by at most the lease cap (5 minutes)';
        ELSIF NOT coalesce(NEW.updated_at >= NEW.heartbeat_at, false) THEN
            why := 'updated_at is not before heartbeat_at';
        END IF;
    END IF;

    IF why IS NULL THEN
        -- Every accepted write's latest stamp is updated_at: bound it by the clock.
        EXECUTE format('SELECT s.clock_allowance FROM %I.mos_lease_settings AS s',
                       TG_TABLE_SCHEMA) INTO allowance;
        latest := clock_timestamp() + coalesce(allowance, interval '0');
        IF NOT coalesce(NEW.updated_at <= latest, false) THEN
            why := 'a write is stamped no later than the database clock';
        END IF;
    END IF;

    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'mos-lease: % on % is refused: %', TG_OP, TG_TABLE_NAME, why
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION mos_lease_check_lease_write() FROM PUBLIC;

-- No CHECK for finite stamps on this table: the triggers below already refuse them on
-- every path, and a CHECK measurably slowed every heartbeat (about 3 us of 42 us server time
-- per renewal); whoever may disable the triggers may drop a CHECK too.

-- 0001's guard (epoch down, identity change) is subsumed by the full check.
DROP TRIGGER logical_agent_connector_leases_fencing ON logical_agent_connector_leases;

-- The WHEN clause is an ordinary renewal stamped by the database clock itself (time offset
-- zero, as in production): such a write is legal, and passes without a function call.
-- Anything else (a renewal stamped ahead of the clock by a test offset included) runs the
-- full check. The clock read here comes after the statement's own, so it is never earlier.
CREATE TRIGGER logical_agent_connector_leases_fencing
    BEFORE UPDATE ON logical_agent_connector_leases
    FOR EACH ROW
    WHEN (NOT coalesce(
              NEW.tenant_id = OLD.tenant_id
              AND NEW.logical_agent_id = OLD.logical_agent_id
              AND NEW.binding_id = OLD.binding_id
              AND NEW.lease_id = OLD.lease_id
              AND NEW.epoch = OLD.epoch
              AND NEW.connector_id = OLD.connector_id
              AND NEW.allowed_scopes = OLD.allowed_scopes
              AND NEW.acquired_at = OLD.acquired_at
              AND OLD.released_at IS NULL
              AND NEW.released_at IS NULL
              AND NEW.expires_at > NEW.heartbeat_at
              AND NEW.expires_at <= NEW.heartbeat_at + interval '5 minutes'
              AND NEW.updated_at >= NEW.heartbeat_at
              AND NEW.updated_at <= clock_timestamp(), false))
    EXECUTE FUNCTION mos_lease_check_lease_write();

-- The same for an insert (an acquire on an identity that has a row fires it too, before
-- ON CONFLICT finds the row; its values are legal all the same).
CREATE TRIGGER logical_agent_connector_leases_insert_shape
    BEFORE INSERT ON logical_agent_connector_leases
    FOR EACH ROW
    WHEN (NOT coalesce(
              NEW.epoch = 1
              AND NEW.released_at IS NULL
              AND NEW.acquired_at = NEW.heartbeat_at
              AND NEW.updated_at = NEW.heartbeat_at
              AND NEW.expires_at > NEW.heartbeat_at
              AND NEW.expires_at <= NEW.heartbeat_at + interval '5 minutes'
              AND NEW.updated_at <= clock_timestamp(), false))
    EXECUTE FUNCTION mos_lease_check_lease_write();

-- Resource high-water marks: they only rise, a resource keeps its identity, and rows are
-- never removed (a removed row would readmit every stale epoch for that resource).
ALTER TABLE connector_resource_epochs
    ADD CONSTRAINT connector_resource_epochs_finite_check CHECK (isfinite(updated_at));

CREATE TRIGGER connector_resource_epochs_fencing
    BEFORE UPDATE ON connector_resource_epochs
    FOR EACH ROW
    WHEN (NOT coalesce(
              NEW.resource_id = OLD.resource_id
              AND NEW.tenant_id = OLD.tenant_id
              AND NEW.logical_agent_id = OLD.logical_agent_id
              AND NEW.binding_id = OLD.binding_id
              AND NEW.highest_epoch >= OLD.highest_epoch, false))
    EXECUTE FUNCTION mos_lease_refuse(
        'resource epochs never go backwards and resource identities never change');
CREATE TRIGGER connector_resource_epochs_no_delete
    BEFORE DELETE ON connector_resource_epochs
    FOR EACH STATEMENT EXECUTE FUNCTION mos_lease_refuse('resource epochs are never deleted');
CREATE TRIGGER connector_resource_epochs_no_truncate
    BEFORE TRUNCATE ON connector_resource_epochs
    FOR EACH STATEMENT EXECUTE FUNCTION mos_lease_refuse('resource epochs are never deleted');
