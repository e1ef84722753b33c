-- An application table that gateways write in fenced effects (`mos-lease roles
-- --effect-table`): whether it exists, and the sequences of its serial columns, which an
-- INSERT draws from (USAGE on them is needed; an identity column's needs none). Schema and
-- name come back apart, to be quoted as identifiers.
SELECT t.oid IS NOT NULL AS present,
       ARRAY(SELECT n.nspname FROM pg_depend AS d
             JOIN pg_class AS s ON s.oid = d.objid AND s.relkind = 'S'
             JOIN pg_namespace AS n ON n.oid = s.relnamespace
             WHERE d.classid = 'pg_class'::regclass AND d.refobjid = t.oid
               AND d.deptype = 'a'
             ORDER BY s.relname) AS sequence_schemas,
       ARRAY(SELECT s.relname::text FROM pg_depend AS d
             JOIN pg_class AS s ON s.oid = d.objid AND s.relkind = 'S'
             WHERE d.classid = 'pg_class'::regclass AND d.refobjid = t.oid
               AND d.deptype = 'a'
             ORDER BY s.relname) AS sequence_names
FROM (SELECT to_regclass(format('%%I.%%I', %(schema)s::text, %(table)s::text))::oid AS oid) AS t
