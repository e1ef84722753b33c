-- 0004: the audit log's integrity, held by the database for every role and every path.
--
-- 1. Event ids are applied at most once. A unique index on a partitioned table must include
--    the partition key, so it cannot make event_id unique across months. Instead every
--    audit row claims its event id in `connector_lease_event_ids`, a plain (unpartitioned)
--    table whose primary key is the event id, from an AFTER INSERT statement trigger on the
--    log and on every partition, present and future: a second row with the same id fails with
--    unique_violation on connector_lease_event_ids_pkey, and with it the whole statement,
--    so a guarded write whose audit row is a duplicate is not applied either. The claim
--    waits for an uncommitted claim of the same id (as any unique index does), so a resend
--    racing its first attempt is refused once that commits. Retention removes the claims
--    of the months it archives (mos_lease_audit_retained).
--
-- 2. Audit time is the database's. A row's recorded_at must lie within the inserting
--    statement's own run on the database clock (statement_timestamp() .. clock_timestamp()):
--    whatever value an INSERT names, it can only be the time the database is at. A test
--    database may allow stamps ahead of the clock (mos_lease_settings.clock_allowance,
--    owner-only, 0 in production); none may stamp into the past. The resendable record
--    function loses its time-offset parameter.
--
-- 3. Retention only moves forward. `mos-lease audit archive` records the newest partition
--    boundary it passed (mos_lease_audit_retention, owner-only), and the DEFAULT partition
--    then refuses, by a CHECK, any row before it: a month that was archived can never
--    receive a row again, by any role, and so never be "adopted" and archived a second
--    time. Adopting rows the DEFAULT caught handles rows of several months (each month gets
--    its own partition), where 0003 refused when their span crossed an existing partition.
--
-- Cost: the claim is one trigger call per INSERT statement and one row with its primary key
-- per audit row, in place of the log's own event-id index, which goes; the stamp check is a
-- WHEN expression that calls nothing for a row stamped by the clock. Measured by
-- `bench/run.py` (event_ids_heartbeat_vs_v3).

-- The event ids applied, one row each, with the key of the audit row that claimed it (seq
-- and recorded_at: the log's primary key, so the row is found through one partition's
-- index). The gateway role may only read it (reconcile looks events up here); the claiming
-- trigger writes it as the owner.
CREATE TABLE connector_lease_event_ids (
    event_id    uuid        NOT NULL,
    seq         bigint      NOT NULL,
    recorded_at timestamptz NOT NULL,
    CONSTRAINT connector_lease_event_ids_pkey PRIMARY KEY (event_id)
);
-- Claims arrive in time order, so a block range index finds those of an archived month at
-- almost no cost per insert.
CREATE INDEX connector_lease_event_ids_recorded_at_idx
    ON connector_lease_event_ids USING brin (recorded_at);
REVOKE ALL ON connector_lease_event_ids FROM PUBLIC;

-- The rows already in the log claim their ids. A log of 0003 may hold an id twice (nothing
-- kept a guarded write's id unique there): the oldest row keeps the claim, and the count of
-- the others is reported, not hidden.
DO $claims$
DECLARE
    twice bigint;
BEGIN
    INSERT INTO connector_lease_event_ids (event_id, seq, recorded_at)
    SELECT DISTINCT ON (a.event_id) a.event_id, a.seq, a.recorded_at
    FROM connector_lease_audit_log AS a
    ORDER BY a.event_id, a.seq;
    SELECT count(*) - count(DISTINCT a.event_id) INTO twice FROM connector_lease_audit_log AS a;
    IF twice > 0 THEN
        RAISE WARNING 'mos-lease: the audit log holds % row(s) whose event id an older row '
            'already has (written before event ids were unique); they are kept', twice;
    END IF;
END
$claims$;

-- The claim: one statement-level trigger per INSERT statement, claiming every row the
-- statement inserted at once from its transition table (a batch of 100 renewals costs one
-- call, not 100; the claims' primary key takes the place of the log's old event-id index,
-- so an append costs about what it did). Its schema is written into the body when the
-- function is made: a dynamic statement would cost more than the claim. Owner's rights (the
-- gateway may not write the claims), and deliberately no SET search_path: a function-level
-- setting is saved and restored on every call, and the body resolves nothing through a
-- search_path (one schema-qualified table, columns of the exact types, no function or
-- operator), so a caller's search_path cannot redirect it.
DO $claim$
DECLARE
    -- Already quoted where needed (see mos_lease_audit_guard in 0003).
    here text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                  WHERE c.oid = 'connector_lease_audit_log'::regclass);
BEGIN
    EXECUTE format($f$
        CREATE FUNCTION %1$s.mos_lease_claim_event_ids() RETURNS trigger
        LANGUAGE plpgsql SECURITY DEFINER AS $body$
        BEGIN
            INSERT INTO %1$s.connector_lease_event_ids (event_id, seq, recorded_at)
            SELECT c.event_id, c.seq, c.recorded_at FROM claimed AS c;
            RETURN NULL;
        END
        $body$$f$, here);
    EXECUTE format('REVOKE ALL ON FUNCTION %s.mos_lease_claim_event_ids() FROM PUBLIC', here);
END
$claim$;

-- On the log, for every statement that appends through it (as every role but the owner
-- must: no other role has a privilege on a partition). A statement naming a partition fires
-- that partition's own statement triggers instead, so every partition carries the claim
-- too: those that exist now (below) and every later one (mos_lease_audit_guard).
CREATE TRIGGER connector_lease_audit_log_event_once
    AFTER INSERT ON connector_lease_audit_log
    REFERENCING NEW TABLE AS claimed
    FOR EACH STATEMENT EXECUTE FUNCTION mos_lease_claim_event_ids();

-- 0003's guard of one partition, with the claim added.
CREATE OR REPLACE FUNCTION mos_lease_audit_guard(part regclass) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    -- regnamespace's text is the schema's name already quoted where it needs quotes.
    here text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                  WHERE c.oid = part);
BEGIN
    EXECUTE format('CREATE TRIGGER connector_lease_audit_log_append_only BEFORE UPDATE OR '
                   'DELETE ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s.mos_lease_refuse(%L)',
                   part, here, 'the audit log is append-only');
    EXECUTE format('CREATE TRIGGER connector_lease_audit_log_no_truncate BEFORE TRUNCATE '
                   'ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s.mos_lease_refuse(%L)',
                   part, here, 'the audit log is append-only');
    EXECUTE format('CREATE TRIGGER connector_lease_audit_log_event_once AFTER INSERT ON %s '
                   'REFERENCING NEW TABLE AS claimed FOR EACH STATEMENT '
                   'EXECUTE FUNCTION %s.mos_lease_claim_event_ids()', part, here);
    EXECUTE format('REVOKE ALL ON %s FROM PUBLIC', part);
END
$$;
REVOKE ALL ON FUNCTION mos_lease_audit_guard(regclass) FROM PUBLIC;

DO $partitions$
DECLARE
    part regclass;
BEGIN
    FOR part IN SELECT i.inhrelid::regclass FROM pg_inherits AS i
                WHERE i.inhparent = 'connector_lease_audit_log'::regclass LOOP
        EXECUTE format('CREATE TRIGGER connector_lease_audit_log_event_once AFTER INSERT ON '
                       '%s REFERENCING NEW TABLE AS claimed FOR EACH STATEMENT '
                       'EXECUTE FUNCTION mos_lease_claim_event_ids()', part);
    END LOOP;
END
$partitions$;

-- Events are looked up in the claims now (event_committed.sql, record_matches.sql): the
-- log's own event-id index (0003) would only double the cost of every append.
DROP INDEX connector_lease_audit_log_event_id_idx;

-- The newest partition boundary a retention step has passed: no audit row may be older.
CREATE TABLE mos_lease_audit_retention (
    singleton      boolean     NOT NULL DEFAULT true,
    retained_from  timestamptz NOT NULL DEFAULT '-infinity',
    CONSTRAINT mos_lease_audit_retention_pkey PRIMARY KEY (singleton),
    CONSTRAINT mos_lease_audit_retention_singleton_check CHECK (singleton)
);
INSERT INTO mos_lease_audit_retention DEFAULT VALUES;
REVOKE ALL ON mos_lease_audit_retention FROM PUBLIC;

-- The full check of an audit row's stamp, for what the WHEN clause below does not pass: a
-- stamp ahead of the clock within the allowance (test databases), never one before the
-- statement began or before what retention passed. Owner's rights, to read the two
-- owner-only settings tables; the tables are found through TG_TABLE_SCHEMA.
CREATE FUNCTION mos_lease_check_audit_stamp() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    allowance interval;
    retained  timestamptz;
    why       text;
BEGIN
    EXECUTE format('SELECT s.clock_allowance FROM %I.mos_lease_settings AS s',
                   TG_TABLE_SCHEMA) INTO allowance;
    EXECUTE format('SELECT r.retained_from FROM %I.mos_lease_audit_retention AS r',
                   TG_TABLE_SCHEMA) INTO retained;
    IF NEW.recorded_at IS NULL OR NOT isfinite(NEW.recorded_at) THEN
        why := 'recorded_at is a finite time';
    ELSIF NEW.recorded_at < coalesce(retained, '-infinity') THEN
        why := format('recorded_at %s lies before %s, which audit retention has passed',
                      NEW.recorded_at, retained);
    ELSIF NEW.recorded_at < statement_timestamp()
          OR NEW.recorded_at > clock_timestamp() + coalesce(allowance, interval '0') THEN
        why := format('audit rows are stamped by the database clock: recorded_at %s lies '
                      'outside this statement''s run (%s to %s)', NEW.recorded_at,
                      statement_timestamp(), clock_timestamp());
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'mos-lease: % on % is refused: %', TG_OP, TG_TABLE_NAME, why
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION mos_lease_check_audit_stamp() FROM PUBLIC;

-- A row stamped by the clock within its own statement passes without a function call
-- (every row the library writes, in production); anything else runs the full check.
CREATE TRIGGER connector_lease_audit_log_stamp
    BEFORE INSERT ON connector_lease_audit_log
    FOR EACH ROW
    WHEN (NOT coalesce(NEW.recorded_at >= statement_timestamp()
                       AND NEW.recorded_at <= clock_timestamp(), false))
    EXECUTE FUNCTION mos_lease_check_audit_stamp();

-- Records that retention passed `boundary` (never moving back), makes the DEFAULT partition
-- of `log` refuse rows before it, and removes the event-id claims of the rows it archived.
-- NULL `boundary` only renews the DEFAULT's CHECK (after the DEFAULT was replaced). Run by
-- `mos-lease audit archive` and by mos_lease_audit_partitions, as the owner.
CREATE FUNCTION mos_lease_audit_retained(log regclass, boundary timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    here     text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                      WHERE c.oid = log);
    fallback text := format('%s.%I', here, 'connector_lease_audit_log_default');
    before   timestamptz;
    retained timestamptz;
BEGIN
    EXECUTE format('SELECT r.retained_from FROM %s.mos_lease_audit_retention AS r FOR UPDATE',
                   here) INTO STRICT before;
    retained := greatest(before, coalesce(boundary, before));
    IF retained > before THEN
        EXECUTE format('UPDATE %s.mos_lease_audit_retention SET retained_from = $1', here)
            USING retained;
        EXECUTE format('DELETE FROM %s.connector_lease_event_ids WHERE recorded_at < $1', here)
            USING retained;
    END IF;
    IF retained > '-infinity' THEN
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT IF EXISTS %I', fallback,
                       'connector_lease_audit_log_default_retained_check');
        EXECUTE format('ALTER TABLE %s ADD CONSTRAINT %I CHECK (recorded_at >= %L)', fallback,
                       'connector_lease_audit_log_default_retained_check', retained);
    END IF;
    RETURN retained;
END
$$;
REVOKE ALL ON FUNCTION mos_lease_audit_retained(regclass, timestamptz) FROM PUBLIC;

-- 0003's maintenance, with adoption that handles rows of any months: the DEFAULT is
-- detached and replaced by a new, empty one (guarded, with retention's CHECK), and its rows
-- are copied, month by month, into a new partition per month, attached whole (the
-- parent's row triggers and indexes are cloned onto it then), all in this transaction;
-- then the old DEFAULT is dropped. A month that already has a partition cannot hold rows
-- of the DEFAULT (PostgreSQL refuses such a partition while the DEFAULT holds its rows).
CREATE OR REPLACE FUNCTION mos_lease_audit_partitions(log regclass, ahead integer)
RETURNS SETOF text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    here        text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                         WHERE c.oid = log);
    fallback    text := format('%s.%I', here, 'connector_lease_audit_log_default');
    adopting    text := format('%s.%I', here, 'connector_lease_audit_log_adopting');
    month_start timestamp := date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC');
    caught      boolean;
    month       timestamp;
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
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', fallback) INTO STRICT caught;
    END IF;
    IF caught THEN  -- (a concurrent run may have adopted them meanwhile)
        EXECUTE format('ALTER TABLE %s DETACH PARTITION %s', log, fallback);
        EXECUTE format('ALTER TABLE %s RENAME TO %I', fallback,
                       'connector_lease_audit_log_adopting');
        EXECUTE format('CREATE TABLE %s PARTITION OF %s DEFAULT', fallback, log);
        EXECUTE format('SELECT %s.mos_lease_audit_guard(%L)', here, fallback);
        EXECUTE format('SELECT %s.mos_lease_audit_retained(%L, NULL)', here, log);
        FOR month IN EXECUTE format(
                $q$SELECT DISTINCT date_trunc('month', d.recorded_at AT TIME ZONE 'UTC')
                   FROM %s AS d ORDER BY 1$q$, adopting) LOOP
            low := month AT TIME ZONE 'UTC';
            high := (month + interval '1 month') AT TIME ZONE 'UTC';
            part_name := 'connector_lease_audit_log_p' || to_char(month, 'YYYYMM');
            BEGIN
                EXECUTE format('CREATE TABLE %s.%I (LIKE %s INCLUDING CONSTRAINTS)',
                               here, part_name, log);
            EXCEPTION WHEN duplicate_table THEN
                RAISE EXCEPTION 'mos-lease: the DEFAULT audit partition holds rows of the '
                    'month from % to %, and a table named % exists already; nothing was '
                    'changed', low, high, part_name
                    USING ERRCODE = 'object_not_in_prerequisite_state';
            END;
            EXECUTE format('INSERT INTO %s.%I SELECT * FROM %s AS d WHERE d.recorded_at >= $1 '
                           'AND d.recorded_at < $2', here, part_name, adopting)
                USING low, high;
            EXECUTE format('ALTER TABLE %s ATTACH PARTITION %s.%I FOR VALUES FROM (%L) TO (%L)',
                           log, here, part_name, low, high);
            EXECUTE format('SELECT %s.mos_lease_audit_guard(%L)', here,
                           format('%s.%I', here, part_name));
            RETURN NEXT part_name;
        END LOOP;
        EXECUTE format('DROP TABLE %s', adopting);
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

-- The resendable record, without 0003's time offset (any role could call it with one and
-- stamp a row in any month): the caller names the stamp it read from the database clock in
-- the same statement, and the stamp check above holds it to that. The look for the event id
-- stays (a resend must answer 0, not fail), serialized per event id as in 0003; the claim
-- trigger refuses a duplicate whatever path it comes by.
DROP FUNCTION mos_lease_record_audit(regclass, uuid, text, text, text, text, text, text, text,
                                     bigint, text, interval);
CREATE FUNCTION mos_lease_record_audit(
    log regclass, p_event_id uuid, p_event text, p_outcome text, p_reason text,
    p_tenant_id text, p_logical_agent_id text, p_binding_id text, p_connector_id text,
    p_epoch bigint, p_correlation_id text, p_recorded_at timestamptz) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    taken boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(1836020588, hashtext(p_event_id::text));
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s.connector_lease_event_ids AS e '
                   'WHERE e.event_id = $1)',
                   (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                    WHERE c.oid = log))
        INTO STRICT taken USING p_event_id;
    IF taken THEN
        RETURN 0;
    END IF;
    EXECUTE format('INSERT INTO %s (event_id, event, outcome, reason, tenant_id, '
                   'logical_agent_id, binding_id, connector_id, epoch, correlation_id, '
                   'recorded_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)', log)
        USING p_event_id, p_event, p_outcome, p_reason, p_tenant_id, p_logical_agent_id,
              p_binding_id, p_connector_id, p_epoch, p_correlation_id, p_recorded_at;
    RETURN 1;
END
$$;
