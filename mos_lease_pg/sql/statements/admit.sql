-- The resource guard's admission: record the token's epoch as the resource's highest, if the
-- token may act (see fencing.py). A refused token matches no row and returns none.
INSERT INTO {schema}.connector_resource_epochs AS e
    (resource_id, tenant_id, logical_agent_id, binding_id, highest_epoch, updated_at)
SELECT %(resource_id)s, %(tenant_id)s, %(logical_agent_id)s, %(binding_id)s,
       %(epoch)s::bigint, clock_timestamp()
WHERE %(not_after)s::timestamptz IS NULL OR %(not_after)s::timestamptz > clock_timestamp()
ON CONFLICT (resource_id) DO UPDATE
    SET highest_epoch = EXCLUDED.highest_epoch, updated_at = clock_timestamp()
    WHERE e.tenant_id = EXCLUDED.tenant_id
      AND e.logical_agent_id = EXCLUDED.logical_agent_id
      AND e.binding_id = EXCLUDED.binding_id
      AND e.highest_epoch <= EXCLUDED.highest_epoch
      AND (%(not_after)s::timestamptz IS NULL
           OR %(not_after)s::timestamptz > clock_timestamp())
RETURNING e.highest_epoch
