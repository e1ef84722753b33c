-- 0001: the lease table, its append-only audit log and the resource-side epoch table.
--
-- Applied by `mos-lease migrate` (mos_lease_pg.migrations) as the owner role, in one
-- transaction, into the first schema of the owner's search_path. Later changes go into
-- new numbered files; this one stays as it was applied.

-- Refuses the statement that fired it. TG_ARGV[0] says why. The function reads no table, so
-- it does not depend on the caller's search_path.
CREATE FUNCTION mos_lease_refuse() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'mos-lease: % on % is refused: %', TG_OP, TG_TABLE_NAME, TG_ARGV[0]
        USING ERRCODE = 'restrict_violation';
END
$$;

-- One row per (tenant, logical agent, binding), never deleted: deleting a row would restart
-- its epoch at 1 below fencing tokens already handed downstream.
CREATE TABLE logical_agent_connector_leases (
    tenant_id        text        NOT NULL,
    logical_agent_id text        NOT NULL,
    binding_id       text        NOT NULL,
    lease_id         uuid        NOT NULL,
    connector_id     text        NOT NULL,
    allowed_scopes   text[]      NOT NULL,
    epoch            bigint      NOT NULL,
    acquired_at      timestamptz NOT NULL,
    heartbeat_at     timestamptz NOT NULL,
    expires_at       timestamptz NOT NULL,
    released_at      timestamptz,
    updated_at       timestamptz NOT NULL,
    CONSTRAINT logical_agent_connector_leases_pkey
        PRIMARY KEY (tenant_id, logical_agent_id, binding_id),
    CONSTRAINT logical_agent_connector_leases_epoch_check CHECK (epoch >= 1),
    CONSTRAINT logical_agent_connector_leases_ids_check CHECK (
        char_length(tenant_id) BETWEEN 1 AND 128
        AND char_length(logical_agent_id) BETWEEN 1 AND 128
        AND char_length(binding_id) BETWEEN 1 AND 128
        AND char_length(connector_id) BETWEEN 1 AND 128),
    CONSTRAINT logical_agent_connector_leases_scopes_check CHECK (
        cardinality(allowed_scopes) <= 64 AND array_position(allowed_scopes, NULL) IS NULL),
    -- Every write sets expiry to (store time + a positive TTL) with the same store time as
    -- heartbeat_at; no other ordering between timestamps is checked, because the database
    -- clock itself may be stepped back.
    CONSTRAINT logical_agent_connector_leases_expiry_check CHECK (expires_at > heartbeat_at)
)
-- Heartbeats rewrite the row; free space on each page keeps them HOT (in-place, no index
-- update).
WITH (fillfactor = 90);

CREATE TRIGGER logical_agent_connector_leases_no_delete
    BEFORE DELETE ON logical_agent_connector_leases
    FOR EACH STATEMENT EXECUTE FUNCTION mos_lease_refuse('lease rows are never deleted');
CREATE TRIGGER logical_agent_connector_leases_no_truncate
    BEFORE TRUNCATE ON logical_agent_connector_leases
    FOR EACH STATEMENT EXECUTE FUNCTION mos_lease_refuse('lease rows are never deleted');
-- The WHEN clause is evaluated without calling the function, so ordinary updates (every
-- heartbeat) pay nothing for this guard.
CREATE TRIGGER logical_agent_connector_leases_fencing
    BEFORE UPDATE ON logical_agent_connector_leases
    FOR EACH ROW
    WHEN (NEW.epoch < OLD.epoch
          OR NEW.tenant_id IS DISTINCT FROM OLD.tenant_id
          OR NEW.logical_agent_id IS DISTINCT FROM OLD.logical_agent_id
          OR NEW.binding_id IS DISTINCT FROM OLD.binding_id)
    EXECUTE FUNCTION mos_lease_refuse('epochs never go backwards and identities never change');

-- Append-only metadata. Deliberately no column for scopes, grants, payloads, approval
-- references, tokens or credentials.
CREATE TABLE connector_lease_audit_log (
    seq              bigint      GENERATED ALWAYS AS IDENTITY,
    event_id         uuid        NOT NULL,
    event            text        NOT NULL,
    outcome          text        NOT NULL,
    reason           text,
    tenant_id        text        NOT NULL,
    logical_agent_id text        NOT NULL,
    binding_id       text        NOT NULL,
    connector_id     text        NOT NULL,
    epoch            bigint,
    correlation_id   text        NOT NULL,
    recorded_at      timestamptz NOT NULL,
    CONSTRAINT connector_lease_audit_log_pkey PRIMARY KEY (seq),
    -- A write and its audit row commit together, so this id is how a write whose commit
    -- outcome was lost is reconciled.
    CONSTRAINT connector_lease_audit_log_event_id_key UNIQUE (event_id),
    CONSTRAINT connector_lease_audit_log_epoch_check CHECK (epoch >= 1),
    -- The vocabulary only grows (new reasons need no migration), so check its shape only.
    CONSTRAINT connector_lease_audit_log_vocabulary_check CHECK (
        event ~ '^[a-z][a-z_]{0,63}$'
        AND outcome ~ '^[a-z][a-z_]{0,63}$'
        AND (reason IS NULL OR reason ~ '^[a-z][a-z_]{0,63}$')),
    -- Only a denial carries a reason.
    CONSTRAINT connector_lease_audit_log_reason_check CHECK (
        reason IS NULL OR outcome = 'denied')
);

CREATE INDEX connector_lease_audit_log_identity_idx
    ON connector_lease_audit_log (tenant_id, logical_agent_id, binding_id, seq);

CREATE TRIGGER connector_lease_audit_log_append_only
    BEFORE UPDATE OR DELETE ON connector_lease_audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION mos_lease_refuse('the audit log is append-only');
CREATE TRIGGER connector_lease_audit_log_no_truncate
    BEFORE TRUNCATE ON connector_lease_audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION mos_lease_refuse('the audit log is append-only');

-- For the downstream, resource-side fencing guard: the highest epoch each resource has seen.
CREATE TABLE connector_resource_epochs (
    resource_id      text        PRIMARY KEY,
    tenant_id        text        NOT NULL,
    logical_agent_id text        NOT NULL,
    binding_id       text        NOT NULL,
    highest_epoch    bigint      NOT NULL CHECK (highest_epoch >= 1),
    updated_at       timestamptz NOT NULL
);
