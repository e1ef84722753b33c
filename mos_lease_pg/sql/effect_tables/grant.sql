-- Let the gateway role write an application table in fenced effects: reach its schema and
-- use the table with the privileges named (SELECT, INSERT, UPDATE, DELETE at most; never
-- TRUNCATE, REFERENCES or TRIGGER). Idempotent. {schema}, {table} and {role} are quoted
-- identifiers and {privileges} keywords from that list (psycopg.sql).
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT {privileges} ON TABLE {table} TO {role};
