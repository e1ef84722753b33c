-- 0007: holder metadata, a small payload per lease that its holder sets when it acquires or
-- takes over (for example its endpoint, so a gateway can route a request to the process
-- that holds the binding); read by current_holder() and `mos-lease status`.
--
-- The column is jsonb, an object of string values (the library checks each entry: at most
-- 16, keys of [A-Za-z0-9_.-]{1,64}, printable values of at most 512 characters, 2,048 bytes
-- of keys and values in all). The database bounds it too, for every role: it is an object
-- and its stored size is at most 4,096 bytes (pg_column_size: the library's largest payload
-- takes under 2,200 bytes as jsonb, so only a write from outside the library meets it; the
-- size of the stored datum is read without converting the value, so the check costs a
-- heartbeat next to nothing).
--
-- It is never written to the audit log or a notice payload: those statements name their
-- columns (audit_write.sql, notify.sql), and neither names this one.
--
-- The transition guard (0002, 0006) lets it change only where the library writes it: an
-- insert sets it, a takeover replaces it; a renewal and a release keep it (the released row
-- still shows who held it). Both the full check, mos_lease_check_lease_write(), and the
-- fast path of the guard's WHEN clause say so; the insert trigger needs no change (an insert
-- may carry any metadata the CHECK allows).
--
-- Upgrades a populated database in place: ADD COLUMN with a constant default rewrites no
-- row (existing leases read as '{}', no metadata), and the CHECK holds for them. A gateway
-- role granted UPDATE on the lease columns (`mos-lease roles`) is granted UPDATE on the
-- new column here too, so gateways keep taking over between `migrate` and the next roles
-- step; running `mos-lease roles` again after the migration does the same.
ALTER TABLE logical_agent_connector_leases
    ADD COLUMN holder_metadata jsonb NOT NULL DEFAULT '{}',
    ADD CONSTRAINT logical_agent_connector_leases_metadata_check CHECK (
        jsonb_typeof(holder_metadata) = 'object' AND pg_column_size(holder_metadata) <= 4096);

-- Whoever may rotate a lease (UPDATE on lease_id: the gateway role) may set its metadata.
DO $$
DECLARE
    grantee oid;
BEGIN
    FOR grantee IN
        SELECT DISTINCT acl.grantee
        FROM pg_catalog.pg_attribute AS a,
             LATERAL pg_catalog.aclexplode(a.attacl) AS acl
        WHERE a.attrelid = 'logical_agent_connector_leases'::regclass
          AND a.attname = 'lease_id'
          AND acl.privilege_type = 'UPDATE'
          AND acl.grantee <> 0
    LOOP
        EXECUTE format('GRANT UPDATE (holder_metadata) ON logical_agent_connector_leases TO %I',
                       pg_catalog.pg_get_userbyid(grantee));
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION mos_lease_check_lease_write() RETURNS trigger
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
              OR NEW.acquired_at IS DISTINCT FROM OLD.acquired_at
              OR NEW.holder_metadata IS DISTINCT FROM OLD.holder_metadata THEN
            why := 'connector, scopes, acquired_at and holder metadata change only with a '
                   'takeover';
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

-- 0006's guard, with holder_metadata unchanged by a renewal and a release.
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
                   AND NEW.holder_metadata = OLD.holder_metadata
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
                      AND NEW.holder_metadata = OLD.holder_metadata
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
