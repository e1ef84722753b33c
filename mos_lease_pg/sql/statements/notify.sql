-- The push notice of a takeover or release: a hint to listeners (mos_lease_pg.notices), never
-- a fence. It selects from `written`, so a write whose guard did not hold sends nothing, and
-- NOTIFY is delivered only when the transaction commits. The payload names the identity, the
-- new epoch and the kind of change; never the lease UUID or the connector's scopes (any role
-- that can connect may LISTEN). The channel is a parameter (statements.notice_channel).
    SELECT pg_notify(%(channel)s, jsonb_build_object(
               't', %(tenant_id)s::text, 'a', %(logical_agent_id)s::text,
               'b', %(binding_id)s::text, 'e', w.epoch, 'k', %(notice)s::text)::text)
    FROM written AS w
