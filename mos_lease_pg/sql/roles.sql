-- mos-lease least-privilege role layout.
--
--   owner role    (default mos_lease_owner)    owns the schema and every mos-lease object;
--                                              runs `mos-lease migrate`. Never used by
--                                              gateways.
--   gateway role  (default mos_lease_gateway)  what every gateway process connects as. It
--                                              can do exactly what the store needs:
--        logical_agent_connector_leases   SELECT, INSERT, UPDATE of the non-identity
--                                         columns (UPDATE also allows the SELECT ... FOR
--                                         UPDATE that settles an in-doubt write)
--        connector_lease_audit_log        SELECT, INSERT (the identity column needs no
--                                         sequence privilege); on its partitions
--                                         nothing (rows are read and appended through
--                                         the parent, which checks only its own grants)
--        connector_resource_epochs        SELECT, INSERT, UPDATE of highest_epoch and
--                                         updated_at (the guard's upsert raises the mark;
--                                         the identity columns are not granted)
--        mos_lease_schema_migrations      nothing
--        connector_lease_event_ids        SELECT (reconcile looks events up; the audit
--                                         log's trigger writes it as the owner)
--        mos_lease_audit_retention        nothing (read by the audit stamp check as the
--                                         owner: SECURITY DEFINER)
--        mos_lease_settings               nothing (the checking function reads it as the
--                                         owner: SECURITY DEFINER)
--        mos_lease_record_audit(...)      EXECUTE, granted to PUBLIC (both forms: one
--                                         record, and a batch of them, 0011): it appends
--                                         a record once per event id with the caller's
--                                         own privileges, so it lets no one do more
--      and nothing else: no DELETE or TRUNCATE anywhere, no CREATE in any schema, no
--      EXECUTE of the schema's other functions (triggers call them without it).
--
-- Privileges are not what keeps the data right: the gateway needs UPDATE of the epoch,
-- the lease UUID and the times, since a takeover sets them all. The tables' triggers
-- (migration 0002) permit only the library's transitions, for every role, the owner
-- included: a lease row is inserted at epoch 1, renewed, released or rotated (epoch + 1
-- with a new lease UUID), with finite stamps no later than the database clock and an expiry
-- at most the lease cap ahead; resource epochs only rise; audit rows and lease rows are
-- never changed or removed. Only a superuser (session_replication_role = replica), or the
-- owner by dropping or disabling the triggers on purpose, can get past them.
--
-- Run it as a superuser, or a role with CREATEROLE that may grant on the schema, in the
-- database that holds (or will hold) the tables:
--
--   psql -d DBNAME -v owner_role=mos_lease_owner -v gateway_role=mos_lease_gateway \
--        -v schema_name=mos_lease -v statement_timeout=5s -v lock_timeout=2s -f roles.sql
--
-- It is idempotent and safe before and after `mos-lease migrate`: it creates what is missing
-- and grants on the tables that exist. Before the first migrate there are no tables yet, so
-- it must run again afterwards (it says so in a NOTICE); `mos-lease setup` runs the whole
-- order (this script, migrate as the owner, this script again), `mos-lease roles` runs
-- just this script, and `mos-lease roles --print` prints it with the values filled in.
-- Run it again after every migrate that adds tables. The roles are created LOGIN without a
-- password: set one (ALTER ROLE ... PASSWORD) or another authentication method in
-- pg_hba.conf.
--
-- The search_path and the timeouts are set on the roles (per database), so they hold even
-- behind a transaction-pooling proxy that drops the connection's startup options.
\set ON_ERROR_STOP on
\if :{?owner_role}
\else
\set owner_role mos_lease_owner
\endif
\if :{?gateway_role}
\else
\set gateway_role mos_lease_gateway
\endif
\if :{?schema_name}
\else
\set schema_name mos_lease
\endif
\if :{?statement_timeout}
\else
\set statement_timeout 5s
\endif
\if :{?lock_timeout}
\else
\set lock_timeout 2s
\endif

-- psql does not substitute variables inside the DO body, so they travel as settings.
\o /dev/null
SELECT set_config('mos_lease.owner_role', :'owner_role', false),
       set_config('mos_lease.gateway_role', :'gateway_role', false),
       set_config('mos_lease.schema_name', :'schema_name', false),
       set_config('mos_lease.statement_timeout', :'statement_timeout', false),
       set_config('mos_lease.lock_timeout', :'lock_timeout', false);
\o

DO $layout$
DECLARE
    owner_role   text := current_setting('mos_lease.owner_role');
    gateway_role text := current_setting('mos_lease.gateway_role');
    schema_name  text := current_setting('mos_lease.schema_name');
    db           text := current_database();
    leases       text;
    audit_log    text;
    epochs       text;
    migrations   text;
    settings     text;
    owner_only   regclass;
    routine      regprocedure;
    part         regclass;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = owner_role) THEN
        EXECUTE format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE', owner_role);
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = gateway_role) THEN
        EXECUTE format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE',
                       gateway_role);
    END IF;
    IF NOT EXISTS (SELECT FROM pg_namespace WHERE nspname = schema_name) THEN
        EXECUTE format('CREATE SCHEMA %I AUTHORIZATION %I', schema_name, owner_role);
    END IF;
    EXECUTE format('REVOKE ALL ON SCHEMA %I FROM PUBLIC', schema_name);
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', schema_name, gateway_role);

    -- Role defaults in this database: where the tables are, and how long a statement or a
    -- lock wait may take (the store also sends these at connect; the role default is what
    -- holds behind a pooling proxy).
    EXECUTE format('ALTER ROLE %I IN DATABASE %I SET search_path = %I',
                   owner_role, db, schema_name);
    EXECUTE format('ALTER ROLE %I IN DATABASE %I SET search_path = %I',
                   gateway_role, db, schema_name);
    EXECUTE format('ALTER ROLE %I IN DATABASE %I SET statement_timeout = %L',
                   gateway_role, db, current_setting('mos_lease.statement_timeout'));
    EXECUTE format('ALTER ROLE %I IN DATABASE %I SET lock_timeout = %L',
                   gateway_role, db, current_setting('mos_lease.lock_timeout'));

    leases := format('%I.logical_agent_connector_leases', schema_name);
    audit_log := format('%I.connector_lease_audit_log', schema_name);
    epochs := format('%I.connector_resource_epochs', schema_name);
    migrations := format('%I.mos_lease_schema_migrations', schema_name);
    settings := format('%I.mos_lease_settings', schema_name);

    IF to_regclass(leases) IS NULL THEN
        -- Grants need the tables: a first run (before migrate) cannot finish the layout.
        RAISE NOTICE 'mos-lease: schema % has no mos-lease tables yet: run `mos-lease migrate` '
            'as %, then run this role step again (`mos-lease setup` does all three)',
            schema_name, owner_role;
    ELSE
        EXECUTE format('REVOKE ALL ON %s FROM PUBLIC, %I', leases, gateway_role);
        EXECUTE format('GRANT SELECT, INSERT ON %s TO %I', leases, gateway_role);
        -- Identity columns are not in the list: a gateway cannot move a row to another
        -- identity even if the trigger were disabled.
        EXECUTE format('GRANT UPDATE (lease_id, connector_id, allowed_scopes, epoch, '
                       'acquired_at, heartbeat_at, expires_at, released_at, updated_at) '
                       'ON %s TO %I', leases, gateway_role);
        -- Migration 0007's column; a table not yet migrated that far has none (the
        -- migration grants it then, to whoever may update lease_id).
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_attribute AS a
                   WHERE a.attrelid = leases::regclass AND a.attname = 'holder_metadata'
                     AND NOT a.attisdropped) THEN
            EXECUTE format('GRANT UPDATE (holder_metadata) ON %s TO %I', leases, gateway_role);
        END IF;
    END IF;
    IF to_regclass(audit_log) IS NOT NULL THEN
        EXECUTE format('REVOKE ALL ON %s FROM PUBLIC, %I', audit_log, gateway_role);
        EXECUTE format('GRANT SELECT, INSERT ON %s TO %I', audit_log, gateway_role);
        -- Partitions (0003; archive drops old ones, maintenance adds new ones): no one but
        -- the owner may name one directly.
        FOR part IN
            SELECT t.relid FROM pg_partition_tree(audit_log::regclass) AS t WHERE t.level > 0
        LOOP
            EXECUTE format('REVOKE ALL ON %s FROM PUBLIC, %I', part, gateway_role);
        END LOOP;
    END IF;
    IF to_regclass(epochs) IS NOT NULL THEN
        EXECUTE format('REVOKE ALL ON %s FROM PUBLIC, %I', epochs, gateway_role);
        EXECUTE format('GRANT SELECT, INSERT ON %s TO %I', epochs, gateway_role);
        -- The admission upsert (ON CONFLICT DO UPDATE) sets only these two columns.
        EXECUTE format('GRANT UPDATE (highest_epoch, updated_at) ON %s TO %I',
                       epochs, gateway_role);
    END IF;
    IF to_regclass(migrations) IS NOT NULL THEN
        EXECUTE format('REVOKE ALL ON %s FROM PUBLIC, %I', migrations, gateway_role);
    END IF;
    IF to_regclass(settings) IS NOT NULL THEN
        EXECUTE format('REVOKE ALL ON %s FROM PUBLIC, %I', settings, gateway_role);
    END IF;
    -- Tables of 0004: the event-id claims (written by the claiming trigger as the owner,
    -- read by reconcile) and the retention boundary (owner-only).
    FOR owner_only IN
        SELECT to_regclass(format('%I.%I', schema_name, t))
        FROM unnest(ARRAY['connector_lease_event_ids', 'mos_lease_audit_retention']) AS t
    LOOP
        IF owner_only IS NOT NULL THEN
            EXECUTE format('REVOKE ALL ON %s FROM PUBLIC, %I', owner_only, gateway_role);
        END IF;
    END LOOP;
    IF to_regclass(format('%I.connector_lease_event_ids', schema_name)) IS NOT NULL THEN
        EXECUTE format('GRANT SELECT ON %I.connector_lease_event_ids TO %I', schema_name,
                       gateway_role);
    END IF;
    -- Functions are executable by PUBLIC by default; the gateway calls none directly.
    FOR routine IN
        SELECT p.oid::regprocedure FROM pg_proc AS p
        JOIN pg_namespace AS n ON n.oid = p.pronamespace
        WHERE n.nspname = schema_name
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC, %I', routine, gateway_role);
    END LOOP;
    -- The resendable record: with a stamp (0004), or with 0003's offset on an older schema;
    -- and its set form (0011), which the library calls from then on.
    FOR routine IN
        SELECT to_regprocedure(format(
            '%I.mos_lease_record_audit(regclass, uuid, text, text, text, text, text, text, '
            'text, bigint, text, %s)', schema_name, last_argument))
        FROM unnest(ARRAY['timestamptz', 'interval']) AS last_argument
        UNION ALL
        SELECT to_regprocedure(format(
            '%I.mos_lease_record_audit(uuid[], text[], text[], text[], text[], text[], '
            'text[], text[], bigint[], text[], timestamptz)', schema_name))
    LOOP
        IF routine IS NOT NULL THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', routine);
        END IF;
    END LOOP;
END
$layout$;
