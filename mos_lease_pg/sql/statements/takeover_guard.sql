-- The compare-and-set of a takeover: the row of this identity at the expected epoch, below
-- the bigint maximum (the epoch never wraps), replacing an active lease only when the policy
-- allowed preemption (an expired or released one always may be), and not stamped later than
-- the time it is judged at (machine.clock_refusal: the clock stepped back). Each {column}
-- is the value it must equal: a parameter of one write (rotate.sql) or a column of a request
-- row of a batch (takeover_many.sql).
    WHERE l.tenant_id = {tenant_id}
      AND l.logical_agent_id = {logical_agent_id}
      AND l.binding_id = {binding_id}
      AND l.epoch = {expected_epoch}
      AND l.epoch < 9223372036854775807
      AND ({preempt_active}::boolean OR l.released_at IS NOT NULL OR l.expires_at <= t.now)
      AND l.updated_at <= t.now
