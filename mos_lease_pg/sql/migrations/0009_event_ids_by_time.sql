-- 0009: event ids held unique by the partition that holds them, not by a second row each.
--
-- 0004 claimed every audit row's event id in `connector_lease_event_ids`: a second row, its
-- primary-key entry and its WAL per audit row, about 6% of a single heartbeat. Now event ids
-- are time-ordered (UUID version 7: the millisecond of minting in the first 48 bits, then
-- the version digit 7; `mos_lease.ids.uuid7`), and that time places an id:
--
-- * A month partition accepts only version-7 ids minted within its month, widened by a day
--   on either side (a CHECK of uuid constants, `connector_lease_audit_log_event_id_time`),
--   and a UNIQUE index on event_id refuses an id twice within it.
-- * So one id can lie in two partitions only if it was minted within a day of the boundary
--   between them; such a row, and only such a row, still claims its id in
--   `connector_lease_event_ids` (a BEFORE INSERT row trigger whose WHEN clause compares the
--   id with two uuid constants, so that a row minted mid-month costs two comparisons and
--   calls nothing). Both rows of an id near a boundary claim it; the second claim fails.
-- * The DEFAULT partition (a month without a partition) claims every row, and holds an id's
--   minting time within a day of its row's stamp: an id it holds could otherwise also lie
--   mid-month in a partition that does not claim.
-- * A partition that already holds rows when it is guarded (those of earlier versions, or
--   rows adopted from the DEFAULT, all claimed already) claims every new row too, under the
--   same CHECK, with a plain index on event_id for lookups. On a fresh database every month
--   partition is empty when it is made.
--
-- Ids of earlier versions (random, version 4) stay claimed, and no new row can repeat one:
-- every new row's id must be of version 7. So event ids stay applied at most once, for every
-- write kind and every path, across every partition; a row's stamp stays the database's
-- clock (0004). The database reads the id's time from constants it compares with, never
-- from the gateway: a gateway whose clock is off by more than a day has its writes refused
-- near the turn of a month (`mos-lease check` reports the clock's offset).
--
-- Lookups by event id (event_committed.sql, record_matches.sql, mos_lease_record_audit)
-- read the log itself, through each partition's index on event_id: every audit row there
-- is has an id in the log, claimed or not.
--
-- Cost: per audit row, a unique index entry where version 3 had a plain one, a CHECK of
-- uuid constants and the version digit; the claim only for rows minted within a day of a
-- month's turn. Measured by `bench/run.py` (event_ids_heartbeat_vs_v3).

-- The uuid that sorts first among those minted at `at` (its millisecond, then zeros).
CREATE FUNCTION mos_lease_event_id_floor(at timestamptz) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT SET search_path = pg_catalog, pg_temp AS $$
    SELECT (substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-0000-0000-000000000000')::uuid
    FROM (SELECT lpad(to_hex(floor(extract(epoch FROM at) * 1000)::bigint), 12, '0') AS h) AS m
$$;
REVOKE ALL ON FUNCTION mos_lease_event_id_floor(timestamptz) FROM PUBLIC;

-- One row's claim, for the rows that must claim (above). Owner's rights (the gateway may
-- not write the claims); the schema is written into the body when it is made, and no SET
-- search_path (saved and restored on every call), as 0004's claim.
DO $claim$
DECLARE
    here text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                  WHERE c.oid = 'connector_lease_audit_log'::regclass);
BEGIN
    EXECUTE format($f$
        CREATE FUNCTION %1$s.mos_lease_claim_event_id() RETURNS trigger
        LANGUAGE plpgsql SECURITY DEFINER AS $body$
        BEGIN
            INSERT INTO %1$s.connector_lease_event_ids (event_id, seq, recorded_at)
            VALUES (NEW.event_id, NEW.seq, NEW.recorded_at);
            RETURN NEW;
        END
        $body$$f$, here);
    EXECUTE format('REVOKE ALL ON FUNCTION %s.mos_lease_claim_event_id() FROM PUBLIC', here);
END
$claim$;

-- How one partition holds its event ids: a month partition that is empty by the index,
-- the CHECK and the claim near its bounds; one that holds rows, or the DEFAULT, by claiming
-- every row. NOT VALID: the CHECK is for the rows to come; those a partition holds were
-- claimed when they came.
CREATE FUNCTION mos_lease_event_ids_guard(part regclass) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    here    text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                     WHERE c.oid = part);
    bound   text := (SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class AS c
                     WHERE c.oid = part);
    low     timestamptz;
    high    timestamptz;
    day     interval := interval '1 day';
    held    boolean;
    outer_low  uuid;  -- the first id the partition accepts, and the first it does not
    outer_high uuid;
    inner_low  uuid;  -- the ids from which on, and before which, it need not claim
    inner_high uuid;
    v7      text := 'substr(event_id::text, 15, 1) = ''7''';
BEGIN
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', part) INTO STRICT held;
    IF bound = 'DEFAULT' THEN
        EXECUTE format('ALTER TABLE %s ADD CONSTRAINT %I CHECK (%s AND abs((''x'' || '
                       'substr(event_id::text, 1, 8) || substr(event_id::text, 10, 4))'
                       '::bit(48)::bigint - floor(extract(epoch FROM recorded_at) * 1000)'
                       '::bigint) < %s) NOT VALID', part,
                       'connector_lease_audit_log_event_id_time', v7,
                       extract(epoch FROM day)::bigint * 1000);
    ELSE
        -- A bound of MINVALUE or MAXVALUE (0003's partition "legacy") borders no other
        -- partition: no id needs a claim there, and any id minted before the upper bound
        -- belongs to this partition alone.
        low := (regexp_match(bound, 'FROM \(''([^'']+)''\)'))[1]::timestamptz;
        high := (regexp_match(bound, 'TO \(''([^'']+)''\)'))[1]::timestamptz;
        IF (low IS NULL AND bound !~ 'FROM \(MINVALUE\)')
           OR (high IS NULL AND bound !~ 'TO \(MAXVALUE\)') THEN
            RAISE EXCEPTION 'mos-lease: % is not a month of the audit log (%)', part, bound
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        EXECUTE format('SELECT coalesce(%1$s.mos_lease_event_id_floor($1 - $3), $4), '
                       'coalesce(%1$s.mos_lease_event_id_floor($2 + $3), $5), '
                       'coalesce(%1$s.mos_lease_event_id_floor($1 + $3), $4), '
                       'coalesce(%1$s.mos_lease_event_id_floor($2 - $3), $5)', here)
            INTO STRICT outer_low, outer_high, inner_low, inner_high
            USING low, high, day, '00000000-0000-0000-0000-000000000000'::uuid,
                  'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid;
        EXECUTE format('ALTER TABLE %s ADD CONSTRAINT %I CHECK (event_id >= %L::uuid AND '
                       'event_id < %L::uuid AND %s) NOT VALID', part,
                       'connector_lease_audit_log_event_id_time',
                       outer_low, outer_high, v7);
    END IF;
    IF held OR bound = 'DEFAULT' THEN
        -- Unnamed: PostgreSQL picks a free name (an adopted DEFAULT keeps its index until it is
        -- dropped), "<partition>_event_id_idx" unless taken.
        EXECUTE format('CREATE INDEX ON %s (event_id)', part);
        EXECUTE format('CREATE TRIGGER connector_lease_audit_log_event_claim BEFORE INSERT '
                       'ON %s FOR EACH ROW EXECUTE FUNCTION %s.mos_lease_claim_event_id()',
                       part, here);
    ELSE
        EXECUTE format('CREATE UNIQUE INDEX ON %s (event_id)', part);
        EXECUTE format('CREATE TRIGGER connector_lease_audit_log_event_claim BEFORE INSERT '
                       'ON %s FOR EACH ROW WHEN (NEW.event_id < %L::uuid OR NEW.event_id >= '
                       '%L::uuid) EXECUTE FUNCTION %s.mos_lease_claim_event_id()', part,
                       inner_low, inner_high, here);
    END IF;
END
$$;
REVOKE ALL ON FUNCTION mos_lease_event_ids_guard(regclass) FROM PUBLIC;

-- 0004's guard of one partition, with this version's event-id guard for 0004's claim.
CREATE OR REPLACE FUNCTION mos_lease_audit_guard(part regclass) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    here text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                  WHERE c.oid = part);
BEGIN
    EXECUTE format('CREATE TRIGGER connector_lease_audit_log_append_only BEFORE UPDATE OR '
                   'DELETE ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s.mos_lease_refuse(%L)',
                   part, here, 'the audit log is append-only');
    EXECUTE format('CREATE TRIGGER connector_lease_audit_log_no_truncate BEFORE TRUNCATE '
                   'ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s.mos_lease_refuse(%L)',
                   part, here, 'the audit log is append-only');
    EXECUTE format('SELECT %s.mos_lease_event_ids_guard(%L)', here, part);
    EXECUTE format('REVOKE ALL ON %s FROM PUBLIC', part);
END
$$;
REVOKE ALL ON FUNCTION mos_lease_audit_guard(regclass) FROM PUBLIC;

-- Every partition there is now: 0004's statement claim goes, this version's guard comes.
DROP TRIGGER connector_lease_audit_log_event_once ON connector_lease_audit_log;
DO $partitions$
DECLARE
    part regclass;
BEGIN
    FOR part IN SELECT i.inhrelid::regclass FROM pg_inherits AS i
                WHERE i.inhparent = 'connector_lease_audit_log'::regclass LOOP
        EXECUTE format('DROP TRIGGER connector_lease_audit_log_event_once ON %s', part);
        PERFORM mos_lease_event_ids_guard(part);
    END LOOP;
END
$partitions$;
DROP FUNCTION mos_lease_claim_event_ids();

-- 0004's resendable record, looking for its event id in the log rather than the claims.
CREATE OR REPLACE FUNCTION mos_lease_record_audit(
    log regclass, p_event_id uuid, p_event text, p_outcome text, p_reason text,
    p_tenant_id text, p_logical_agent_id text, p_binding_id text, p_connector_id text,
    p_epoch bigint, p_correlation_id text, p_recorded_at timestamptz) RETURNS integer
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
                   'recorded_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)', log)
        USING p_event_id, p_event, p_outcome, p_reason, p_tenant_id, p_logical_agent_id,
              p_binding_id, p_connector_id, p_epoch, p_correlation_id, p_recorded_at;
    RETURN 1;
END
$$;
