-- 0003: the audit log partitioned by month of recorded_at (UTC), so that retention removes
-- whole old months (`mos-lease audit archive`, as the owner: export, verify, detach, drop)
-- while no role can change or delete a single row.
--
-- The populated table of 0002 is kept, not copied: it is renamed and attached as the
-- partition "legacy", covering everything up to the end of the month of its newest row (or
-- of now). Every row keeps its seq, and the new parent's identity carries on after the
-- highest value the old sequence handed out. A DEFAULT partition catches a row whose month
-- has no partition yet, so a gateway write never fails for want of one; the maintenance
-- function below creates the months ahead and adopts rows the default caught.
--
-- Uniqueness of event_id: a UNIQUE constraint on a partitioned table must include the
-- partition key, which would make it useless. Guarded writes insert a fresh event id per
-- attempt and are never resent (a lost one is reconciled), so they need no check. A record
-- (refusal, grant issue) may be resent after a lost connection: it goes through
-- mos_lease_record_audit, which serializes on its event id and looks before inserting.

LOCK TABLE connector_lease_audit_log IN ACCESS EXCLUSIVE MODE;

-- Where the new identity starts: after every value the old sequence handed out (a rolled
-- back insert consumed one too), and after every row. Kept for this transaction only.
SELECT set_config('mos_lease.audit_next_seq', (greatest(
    coalesce((SELECT max(a.seq) FROM connector_lease_audit_log AS a), 0),
    coalesce(pg_sequence_last_value(
        pg_get_serial_sequence('connector_lease_audit_log', 'seq')::regclass), 0)) + 1)::text,
    true);

ALTER TABLE connector_lease_audit_log RENAME TO connector_lease_audit_log_legacy;
-- A partition carries no identity of its own: the parent's hands out seq from now on.
ALTER TABLE connector_lease_audit_log_legacy ALTER COLUMN seq DROP IDENTITY;
-- Index names are schema-wide: the parent takes the old names. The parent's own indexes
-- are built on this partition when it is attached (the identity index is reused).
ALTER TABLE connector_lease_audit_log_legacy
    DROP CONSTRAINT connector_lease_audit_log_pkey;
ALTER TABLE connector_lease_audit_log_legacy
    DROP CONSTRAINT connector_lease_audit_log_event_id_key;
ALTER INDEX connector_lease_audit_log_identity_idx
    RENAME TO connector_lease_audit_log_legacy_identity_idx;

-- The same columns and checks as 0001. The primary key includes the partition key, as it
-- must; seq alone still orders and pages the log (audit.sql).
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
    CONSTRAINT connector_lease_audit_log_pkey PRIMARY KEY (seq, recorded_at),
    CONSTRAINT connector_lease_audit_log_epoch_check CHECK (epoch >= 1),
    CONSTRAINT connector_lease_audit_log_vocabulary_check CHECK (
        event ~ '^[a-z][a-z_]{0,63}$'
        AND outcome ~ '^[a-z][a-z_]{0,63}$'
        AND (reason IS NULL OR reason ~ '^[a-z][a-z_]{0,63}$')),
    CONSTRAINT connector_lease_audit_log_reason_check CHECK (
        reason IS NULL OR outcome = 'denied')
) PARTITION BY RANGE (recorded_at);

CREATE INDEX connector_lease_audit_log_identity_idx
    ON connector_lease_audit_log (tenant_id, logical_agent_id, binding_id, seq);
-- How reconcile finds a write's audit row (event_committed.sql, record_matches.sql).
CREATE INDEX connector_lease_audit_log_event_id_idx ON connector_lease_audit_log (event_id);

-- Statements on the parent are refused as before (same trigger names as 0001).
CREATE TRIGGER connector_lease_audit_log_append_only
    BEFORE UPDATE OR DELETE ON connector_lease_audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION mos_lease_refuse('the audit log is append-only');
CREATE TRIGGER connector_lease_audit_log_no_truncate
    BEFORE TRUNCATE ON connector_lease_audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION mos_lease_refuse('the audit log is append-only');
-- Statement triggers of a parent do not fire for a statement naming a partition; row
-- triggers of a parent are cloned onto every partition, present and future. So every row
-- is guarded wherever the statement names it. TRUNCATE has only statement triggers: each
-- partition gets its own (mos_lease_audit_guard).
CREATE TRIGGER connector_lease_audit_log_rows_append_only
    BEFORE UPDATE OR DELETE ON connector_lease_audit_log
    FOR EACH ROW EXECUTE FUNCTION mos_lease_refuse('the audit log is append-only');

-- The guards one partition carries itself, and no privilege for anyone but the owner:
-- reads and appends go through the parent, which checks the parent's privileges only.
-- The functions of this migration find the tables through the regclass they are given
-- (the schema they run in), never through a search_path.
CREATE FUNCTION mos_lease_audit_guard(part regclass) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    -- regnamespace's text is the schema's name already quoted where it needs quotes (a
    -- keyword such as "select"): quoting it again would name another schema.
    refuse text := (SELECT format('%s.mos_lease_refuse', c.relnamespace::regnamespace)
                    FROM pg_class AS c WHERE c.oid = part);
BEGIN
    EXECUTE format('CREATE TRIGGER connector_lease_audit_log_append_only BEFORE UPDATE OR '
                   'DELETE ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s(%L)',
                   part, refuse, 'the audit log is append-only');
    EXECUTE format('CREATE TRIGGER connector_lease_audit_log_no_truncate BEFORE TRUNCATE '
                   'ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s(%L)',
                   part, refuse, 'the audit log is append-only');
    EXECUTE format('REVOKE ALL ON %s FROM PUBLIC', part);
END
$$;
REVOKE ALL ON FUNCTION mos_lease_audit_guard(regclass) FROM PUBLIC;

-- The old table keeps its 0001 triggers; it is attached below (or dropped, if empty).
DO $attach$
DECLARE
    upper_bound timestamptz;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM connector_lease_audit_log_legacy) THEN
        DROP TABLE connector_lease_audit_log_legacy;
        RETURN;
    END IF;
    SELECT (date_trunc('month', greatest(max(a.recorded_at), clock_timestamp())
                                AT TIME ZONE 'UTC') + interval '1 month') AT TIME ZONE 'UTC'
      INTO upper_bound
      FROM connector_lease_audit_log_legacy AS a;
    EXECUTE format('ALTER TABLE connector_lease_audit_log ATTACH PARTITION '
                   'connector_lease_audit_log_legacy FOR VALUES FROM (MINVALUE) TO (%L)',
                   upper_bound);
    EXECUTE 'REVOKE ALL ON connector_lease_audit_log_legacy FROM PUBLIC';
END
$attach$;

CREATE TABLE connector_lease_audit_log_default PARTITION OF connector_lease_audit_log DEFAULT;
SELECT mos_lease_audit_guard('connector_lease_audit_log_default');

DO $identity$
BEGIN
    EXECUTE format('ALTER TABLE connector_lease_audit_log ALTER COLUMN seq RESTART WITH %s',
                   current_setting('mos_lease.audit_next_seq')::bigint);
END
$identity$;

-- Creates the monthly partitions of the audit log `log` from the current month (UTC)
-- through `ahead` months after it, those missing; returns the names it created. Run by
-- `migrate` and by `mos-lease audit partitions`, as the owner. Rows the DEFAULT partition
-- caught (no partition existed for their month) are adopted first: the default is
-- detached, attached as a partition of the months its rows span, and a new, empty default
-- takes its place, so no row is moved or deleted. That needs the parent's ACCESS EXCLUSIVE
-- lock for a moment, taken only then.
CREATE FUNCTION mos_lease_audit_partitions(log regclass, ahead integer) RETURNS SETOF text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    -- Already quoted where needed (see mos_lease_audit_guard).
    here        text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                         WHERE c.oid = log);
    fallback    text := format('%s.%I', here, 'connector_lease_audit_log_default');
    month_start timestamp := date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC');
    caught      boolean;
    low         timestamptz;
    high        timestamptz;
    part_name   text;
BEGIN
    IF ahead IS NULL OR ahead < 0 OR ahead > 120 THEN
        RAISE EXCEPTION 'mos-lease: months ahead must be between 0 and 120, not %', ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', fallback) INTO STRICT caught;
    IF caught THEN
        EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', log);
        EXECUTE format($q$SELECT date_trunc('month', min(d.recorded_at) AT TIME ZONE 'UTC')
                              AT TIME ZONE 'UTC',
                          (date_trunc('month', max(d.recorded_at) AT TIME ZONE 'UTC')
                           + interval '1 month') AT TIME ZONE 'UTC'
                          FROM %s AS d$q$, fallback) INTO low, high;
    END IF;
    IF low IS NOT NULL THEN  -- (a concurrent run may have adopted them meanwhile)
        part_name := 'connector_lease_audit_log_p' || to_char(low AT TIME ZONE 'UTC', 'YYYYMM');
        EXECUTE format('ALTER TABLE %s DETACH PARTITION %s', log, fallback);
        EXECUTE format('ALTER TABLE %s RENAME TO %I', fallback, part_name);
        BEGIN
            EXECUTE format('ALTER TABLE %s ATTACH PARTITION %s.%I FOR VALUES FROM (%L) TO (%L)',
                           log, here, part_name, low, high);
        EXCEPTION WHEN invalid_object_definition OR duplicate_table THEN
            RAISE EXCEPTION 'mos-lease: the DEFAULT audit partition holds rows from % to %, '
                'a range that overlaps existing partitions; adopt them by hand', low, high
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END;
        EXECUTE format('CREATE TABLE %s PARTITION OF %s DEFAULT', fallback, log);
        EXECUTE format('SELECT %s.mos_lease_audit_guard(%L)', here, fallback);
        RETURN NEXT part_name;
    END IF;
    FOR i IN 0..ahead LOOP
        low := (month_start + make_interval(months => i)) AT TIME ZONE 'UTC';
        high := (month_start + make_interval(months => i + 1)) AT TIME ZONE 'UTC';
        part_name := 'connector_lease_audit_log_p' || to_char(low AT TIME ZONE 'UTC', 'YYYYMM');
        BEGIN
            EXECUTE format('CREATE TABLE %s.%I PARTITION OF %s FOR VALUES FROM (%L) TO (%L)',
                           here, part_name, log, low, high);
        EXCEPTION WHEN duplicate_table OR invalid_object_definition OR unique_violation THEN
            CONTINUE;  -- that month has a partition already (maybe under another name)
        END;
        EXECUTE format('SELECT %s.mos_lease_audit_guard(%L)', here,
                       format('%s.%I', here, part_name));
        RETURN NEXT part_name;
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION mos_lease_audit_partitions(regclass, integer) FROM PUBLIC;

SELECT count(*) FROM mos_lease_audit_partitions('connector_lease_audit_log', 3);

-- One audit record that may be resent (a refusal or a grant issue) into the audit log
-- `log`: inserted unless its event id is recorded already; returns how many rows it
-- inserted (0 or 1). The lock makes two records of one id take turns, and the look runs
-- after it with a fresh snapshot (each statement of a volatile PL/pgSQL function in READ
-- COMMITTED takes one), so it sees a concurrent record of the same id that committed first.
-- Transaction-scoped, so it also holds through a transaction-pooling proxy. Runs with the
-- caller's privileges, so it can append only where the caller could append anyway: hence
-- executable by every role that may use the schema (roles.sql keeps it so), as the INSERT
-- it replaces needed only the table's privileges.
CREATE FUNCTION mos_lease_record_audit(
    log regclass, p_event_id uuid, p_event text, p_outcome text, p_reason text,
    p_tenant_id text, p_logical_agent_id text, p_binding_id text, p_connector_id text,
    p_epoch bigint, p_correlation_id text, p_offset interval) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    taken boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(1836020588, hashtext(p_event_id::text));
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s AS a WHERE a.event_id = $1)', log)
        INTO STRICT taken USING p_event_id;
    IF taken THEN
        RETURN 0;
    END IF;
    EXECUTE format('INSERT INTO %s (event_id, event, outcome, reason, tenant_id, '
                   'logical_agent_id, binding_id, connector_id, epoch, correlation_id, '
                   'recorded_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, '
                   'clock_timestamp() + $11)', log)
        USING p_event_id, p_event, p_outcome, p_reason, p_tenant_id, p_logical_agent_id,
              p_binding_id, p_connector_id, p_epoch, p_correlation_id, p_offset;
    RETURN 1;
END
$$;
