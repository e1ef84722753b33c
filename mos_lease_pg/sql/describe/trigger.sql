SELECT c.relname, t.tgname, t.tgenabled::text, pg_get_triggerdef(t.oid)
FROM pg_trigger t
JOIN pg_class c ON c.oid = t.tgrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND NOT t.tgisinternal
ORDER BY 1, 2
