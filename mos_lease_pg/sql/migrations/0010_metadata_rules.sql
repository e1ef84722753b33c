-- 0010: the database holds new holder metadata to the library's own rules.
--
-- 0007 bounded the column only as "a JSON object of at most 4,096 bytes", so a write made
-- around the library (SQL run as the gateway role) could set a payload no library write
-- could: a non-string or nested value, a key outside the key grammar, control characters
-- (a terminal's escape sequences) in a key or a value. From this version on the database
-- refuses such a payload wherever a write sets it, for every role, with the rule of
-- mos_lease.metadata.check_metadata written in SQL (mos_lease_metadata_problem; its tests
-- hold the two to the same verdicts):
--
-- * a JSON object of at most 16 entries;
-- * each key 1 to 64 characters of [A-Za-z0-9_.-];
-- * each value a JSON string of at most 512 characters, with no character the library
--   refuses as unprintable: control characters (C0, DEL, C1), format characters (bidi
--   overrides, zero-width characters, the byte order mark and the others of Unicode's
--   category Cf), separators other than the space (non-breaking and wide spaces, line and
--   paragraph separators) and private-use code points. Python's str.isprintable also
--   refuses code points its Unicode version leaves unassigned; which those are changes
--   with each Unicode version, so the database does not restate them and the library's
--   own check on read (mos_lease.metadata.stored_metadata) withholds them;
-- * all keys and values together at most 2,048 bytes of UTF-8.
--
-- Enforced by a trigger, not a CHECK constraint, and only where a write sets the column:
-- an INSERT with metadata, and an UPDATE that names holder_metadata (a takeover; the guard
-- of 0007/0008 lets nothing else change it). A CHECK is evaluated on every new row version,
-- so it would cost every heartbeat a call, and (added NOT VALID for the rows already there)
-- it would refuse the renewal and the release of a row that already holds bad metadata:
-- metadata plays no part in a lease's safety, and must not stop one.
--
-- Rows already holding metadata that breaks the rules are kept as they are: lease rows are
-- never deleted, the guard lets a row's metadata change only with a takeover, and what a
-- gateway role planted is evidence an operator may want to read. The migration changes no
-- row and cannot fail on one. The library withholds such metadata on every read
-- (current_holder() returns metadata_invalid, `mos-lease status` shows a marker); the next
-- takeover of the row replaces it. Find them with
--   SELECT tenant_id, logical_agent_id, binding_id, epoch
--   FROM <schema>.logical_agent_connector_leases
--   WHERE <schema>.mos_lease_metadata_problem(holder_metadata) IS NOT NULL;

-- Why ``metadata`` breaks the rules above (NULL: it does not). The messages name no key
-- and quote no value: they reach logs and terminals.
CREATE FUNCTION mos_lease_metadata_problem(metadata jsonb) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    entry   record;
    item    text;
    entries integer := 0;
    size    integer := 0;
BEGIN
    IF jsonb_typeof(metadata) <> 'object' THEN
        RETURN 'holder metadata is a JSON object';
    END IF;
    FOR entry IN SELECT e.key, e.value FROM jsonb_each(metadata) AS e LOOP
        entries := entries + 1;
        IF entries > 16 THEN
            RETURN 'holder metadata has at most 16 entries';
        END IF;
        IF entry.key !~ '^[A-Za-z0-9_.-]{1,64}$' THEN
            RETURN 'a holder metadata key is 1 to 64 characters of [A-Za-z0-9_.-]';
        END IF;
        IF jsonb_typeof(entry.value) <> 'string' THEN
            RETURN 'a holder metadata value is a string';
        END IF;
        item := entry.value #>> '{}';
        IF length(item) > 512 THEN
            RETURN 'a holder metadata value is at most 512 characters';
        END IF;
        -- Every code point Python's str.isprintable refuses but those Unicode leaves
        -- unassigned and the surrogates (jsonb holds neither NUL nor a surrogate):
        -- categories Cc, Cf, Zs but the space, Zl, Zp and Co of Unicode 14 (Python 3.11),
        -- and the format controls Unicode 15 added (U+13439..U+1343F).
        IF item ~ ('[\u0001-\u001f\u007f-\u00a0\u00ad\u0600-\u0605\u061c\u06dd\u070f'
                   '\u0890-\u0891\u08e2\u1680\u180e\u2000-\u200f\u2028-\u202f'
                   '\u205f-\u2064\u2066-\u206f\u3000\ue000-\uf8ff\ufeff\ufff9-\ufffb'
                   '\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3'
                   '\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f'
                   '\U000f0000-\U000ffffd\U00100000-\U0010fffd]') THEN
            RETURN 'a holder metadata value is printable (no control, format or '
                   'separator characters but the space)';
        END IF;
        size := size + octet_length(entry.key) + octet_length(convert_to(item, 'UTF8'));
        IF size > 2048 THEN
            RETURN 'holder metadata keys and values take at most 2048 bytes of UTF-8';
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION mos_lease_metadata_problem(jsonb) FROM PUBLIC;

-- The trigger's function calls the rule in this schema by name: the schema is written into
-- its body when it is made (its SET search_path pins only pg_catalog). Owner's rights, as
-- the transition guard's: the gateway role may execute none of the schema's functions.
DO $refuse$
DECLARE
    here text := (SELECT c.relnamespace::regnamespace::text FROM pg_class AS c
                  WHERE c.oid = 'logical_agent_connector_leases'::regclass);
BEGIN
    EXECUTE format($f$
        CREATE FUNCTION %1$s.mos_lease_refuse_bad_metadata() RETURNS trigger
        LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $body$
        DECLARE
            why text := %1$s.mos_lease_metadata_problem(NEW.holder_metadata);
        BEGIN
            IF why IS NOT NULL THEN
                RAISE EXCEPTION 'mos-lease: %% on %% is refused: %%', TG_OP, TG_TABLE_NAME, why
                    USING ERRCODE = 'check_violation';
            END IF;
            RETURN NEW;
        END
        $body$$f$, here);
    EXECUTE format('REVOKE ALL ON FUNCTION %s.mos_lease_refuse_bad_metadata() FROM PUBLIC',
                   here);
END
$refuse$;

-- An empty object (most leases, and every renewal, which names no metadata) calls nothing.
CREATE TRIGGER logical_agent_connector_leases_metadata_insert
    BEFORE INSERT ON logical_agent_connector_leases
    FOR EACH ROW
    WHEN (NEW.holder_metadata <> '{}'::jsonb)
    EXECUTE FUNCTION mos_lease_refuse_bad_metadata();

CREATE TRIGGER logical_agent_connector_leases_metadata_update
    BEFORE UPDATE OF holder_metadata ON logical_agent_connector_leases
    FOR EACH ROW
    WHEN (NEW.holder_metadata <> '{}'::jsonb)
    EXECUTE FUNCTION mos_lease_refuse_bad_metadata();
