-- The push notices of a batched takeover or release: one per write applied, as notify.sql
-- sends for a single one (the same payload, from the written row), delivered only when the
-- transaction commits.
    SELECT pg_notify(%(channel)s, jsonb_build_object(
               't', w.tenant_id, 'a', w.logical_agent_id, 'b', w.binding_id,
               'e', w.epoch, 'k', %(notice)s::text)::text)
    FROM written AS w
