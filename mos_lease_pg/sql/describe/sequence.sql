SELECT c.relname, format_type(s.seqtypid, NULL), s.seqstart::text,
       s.seqincrement::text, s.seqmax::text, s.seqmin::text, s.seqcycle::text
FROM pg_sequence s
JOIN pg_class c ON c.oid = s.seqrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s
ORDER BY 1
