-- One row per privilege asked about: whether the table (and column) exists and whether the
-- current role holds it; the schema's facts are repeated on every row. Only catalogs and
-- privilege functions, readable by every role, so it never fails for lack of a grant.
SELECT n.oid IS NOT NULL, coalesce(has_schema_privilege(n.oid, 'USAGE'), false),
       coalesce(has_schema_privilege(n.oid, 'CREATE'), false),
       (SELECT r.rolsuper FROM pg_roles AS r WHERE r.rolname = current_user),
       current_user::text, current_database()::text,
       (SELECT obj_description(m.oid, 'pg_class') FROM pg_class AS m
        WHERE m.relnamespace = n.oid AND m.relname = %(migrations)s),
       (SELECT has_table_privilege(m.oid, 'SELECT') FROM pg_class AS m
        WHERE m.relnamespace = n.oid AND m.relname = %(migrations)s),
       w.relname, w.privilege, w.attname, c.oid IS NOT NULL,
       CASE WHEN c.oid IS NULL THEN false
            WHEN w.attname IS NULL THEN has_table_privilege(c.oid, w.privilege)
            WHEN a.attnum IS NULL THEN false
            ELSE has_column_privilege(c.oid, a.attnum, w.privilege) END,
       (SELECT count(*) FROM pg_inherits AS i JOIN pg_class AS p ON p.oid = i.inhparent
        WHERE p.relnamespace = n.oid AND p.relname = %(audit)s
          AND has_table_privilege(i.inhrelid,
                                  'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, TRIGGER'))
FROM unnest(%(relnames)s::text[], %(privileges)s::text[], %(attnames)s::text[])
         AS w(relname, privilege, attname)
LEFT JOIN pg_namespace AS n ON n.nspname = %(schema)s
LEFT JOIN pg_class AS c ON c.relnamespace = n.oid AND c.relname = w.relname
LEFT JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attname = w.attname
                           AND NOT a.attisdropped
