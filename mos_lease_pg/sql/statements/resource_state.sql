-- Read after a refused admission, to name the refusal: always one row (NULLs if the
-- resource is unknown).
SELECT clock_timestamp(), e.tenant_id, e.logical_agent_id, e.binding_id, e.highest_epoch
FROM (SELECT 1) AS one
LEFT JOIN {schema}.connector_resource_epochs AS e ON e.resource_id = %(resource_id)s
