/*
 * lease.pml: a Promela model of mos-lease's fencing protocol (for the spin model checker).
 *
 * What it models (see README.md next to this file for the full account and the bounds):
 *
 *   - ONE lease row (a single identity/binding), the only shared durable state. Every
 *     guarded write is a single atomic step that reproduces mos_lease.machine.guard_holds
 *     and apply_write, appends the write's audit event and answers the gateway.
 *   - A database clock: `now`, advanced only by the Clock process. Gateways read it only
 *     inside store steps (a Load or an Apply), never on their own.
 *   - NG gateway processes running the coordinator flows (acquire, takeover, heartbeat,
 *     release, grant issue, validate, restart) on behalf of NC connectors, interleaved.
 *   - Connectors are data: a lease handle and a grant each. Any gateway may serve any
 *     connector's handle; a grant is accepted only by the gateway generation that minted it.
 *   - Commit outcome unknown: a write may be dropped before commit or commit with its reply
 *     lost; the gateway reconciles by asking whether its audit event committed.
 *
 * Safety (assertions, checked with -DSAFETY):
 *   A1 (Monitor, every state) at most one (epoch, lease id) pair is accepted by any gateway's
 *      validation, and any grant a gateway would accept names the current row's epoch and
 *      lease id with the row active now and its epoch the highest ever committed (so a grant
 *      from before a committed takeover is never accepted). NVALID, the number of connectors
 *      whose grant some gateway would accept right now, is at most one.
 *   A2 (validate step) a validation that succeeds does so for the current row, active now,
 *      by the gateway generation that minted the grant.
 *   A3 (every write) epochs only increase, by exactly one per takeover, never past MAX_EPOCH
 *      (no wrap), and the audit row's epoch (success_epoch) is the epoch the row is now at.
 *   A4 (every reply) the outcome a gateway reports agrees with the durable audit: success
 *      only if its event committed, a denial only if it did not.
 *   A5 (every write) time is read after the lock: no renewal or release of a lease commits
 *      after another process observed that lease expired (exp_seen).
 *
 * The row lock: a guarded write first waits for the lease row's lock, then reads the clock,
 * then judges its guard and commits, holding the lock. The Blocker process stands for a
 * session holding the row (a fenced effect's FOR SHARE, another write): while it holds the
 * lock, writes wait, the clock runs and unlocked reads (Load, validate) go on.
 *
 * Deliberately broken variants (each must produce a counterexample):
 *   -DBUG_CACHED_VALIDATE  validation trusts the gateway's cached row instead of rereading
 *   -DBUG_NO_EPOCH_CAS     the store's takeover guard omits `row.epoch == expected_epoch`
 *   -DBUG_BLIND_RETRY      a write whose reply was lost is retried without reconciling
 *   -DBUG_EPOCH_WRAP       takeover omits the `row.epoch < MAX_EPOCH` refusal and guard;
 *                          the epoch counter wraps like a fixed-width integer
 *   -DBUG_CLOCK_BEFORE_LOCK a write reads the clock before it waits for the row lock (the
 *                          order guarded_write.sql had before the lock came first)
 */

/* ---- coverage ------------------------------------------------------------------------
 * REACH(n) marks a path a property depends on. The first time the search executes it, pan
 * prints "REACHED n"; check.sh fails if any marker in this file was never printed, so no
 * property can hold vacuously because the bounds made its scenario unreachable. The C
 * array lives outside the state vector; a trail replay (spin -t) skips it. */
c_code { int reach_seen[16]; }
#define REACH(n) c_code { if (!reach_seen[n]) { reach_seen[n] = 1; printf("REACHED %d\n", n); } }

/* ---- bounds (override with spin -D...) ------------------------------------------------ */
#ifndef MAX_EPOCH
#define MAX_EPOCH 3      /* stands in for 2**63-1: a takeover at this epoch is refused   */
#endif
#ifndef MAX_TICK
#define MAX_TICK 3       /* the database clock runs 0..MAX_TICK                          */
#endif
#ifndef LEASE_TTL
#define LEASE_TTL 2      /* lease ttl in ticks (acquire, takeover, heartbeat)            */
#endif
#ifndef GRANT_TTL
#define GRANT_TTL 1      /* grant ttl in ticks; a grant never outlives its lease         */
#endif
#ifndef MAX_FAULTS
#define MAX_FAULTS 1     /* lost replies / dropped connections, over the whole run       */
#endif
#ifndef MAX_RESTARTS
#define MAX_RESTARTS 1   /* restarts per gateway                                         */
#endif

#define NG 2             /* gateway processes */
#define NC 2             /* connectors        */

/* write kinds: machine.Insert / Renew / Close / Rotate */
#define W_INSERT 1
#define W_RENEW  2
#define W_CLOSE  3
#define W_ROTATE 4

/* what a store Apply answered */
#define RES_OK   1       /* guard held, committed, reply received */
#define RES_FAIL 2       /* guard failed, nothing written          */
#define RES_LOST 3       /* CommitOutcomeUnknown                   */

/* ---- the durable lease row (LeaseRow); lease ids 1.. are unique, 0 = none ------------- */
bool r_exists;
byte r_epoch;
byte r_lid;
byte r_conn;
byte r_exp;            /* expires_at, in ticks */
bool r_rel;            /* released_at is set   */

byte now;              /* the store's clock: the only time authority */

bool blocked;          /* the Blocker holds the row lock: guarded writes wait            */
bool exp_seen;         /* ghost: some read observed the current lease expired (A5)       */

/* audit log, as far as reconciliation needs it: whether the event of gateway g's current
 * lifecycle attempt has been appended (Committed(event_id)). Each attempt has a fresh
 * event id, and a gateway only ever asks about its own current one, so one bit per
 * gateway is that question's answer. */
bool ev_committed[NG];

byte next_lid = 1;     /* the next fresh lease id (see README: ids are drawn at commit) */
byte hi_epoch;         /* ghost: the highest epoch ever committed */
byte faults;           /* ghost budget of injected commit-outcome-unknown faults */

/* ---- gateways ------------------------------------------------------------------------- */
byte gen[NG];          /* restart generation; a restart forgets every grant it minted */

#ifdef BUG_CACHED_VALIDATE
/* the row as gateway g last read it (only the broken variant uses it) */
bool k_exists[NG];
byte k_epoch[NG];
byte k_lid[NG];
byte k_conn[NG];
byte k_exp[NG];
bool k_rel[NG];
#define REMEMBER_ROW() k_exists[g] = r_exists; k_epoch[g] = r_epoch; k_lid[g] = r_lid; \
                       k_conn[g] = r_conn; k_exp[g] = r_exp; k_rel[g] = r_rel
#define FORGET_ROW()   k_exists[g] = 0; k_epoch[g] = 0; k_lid[g] = 0; k_conn[g] = 0; \
                       k_exp[g] = 0; k_rel[g] = 0
#else
#define REMEMBER_ROW() skip
#define FORGET_ROW()   skip
#endif

/* ---- connectors: a lease handle (LeaseHandle) and the last grant received -------------- */
bool h_has[NC];
byte h_epoch[NC];
byte h_lid[NC];

bool gr_has[NC];
byte gr_gw[NC];        /* the gateway that minted it       */
byte gr_gen[NC];       /* ... and that gateway's generation */
byte gr_epoch[NC];
byte gr_lid[NC];
byte gr_exp[NC];

/* ---- machine.py, transcribed ---------------------------------------------------------- */

/* LeaseRow.state(now) is ACTIVE; a write judges it at wnow, the time it read */
#define ROW_ACTIVE_AT(t) (r_exists && !r_rel && r_exp > (t))
#define ROW_ACTIVE ROW_ACTIVE_AT(now)

/* _matches(row, connector_id, lease_id, epoch) */
#define MATCHES(conn, lid, ep) (r_epoch == (ep) && r_lid == (lid) && r_conn == (conn))

#ifdef BUG_NO_EPOCH_CAS
#define EPOCH_CAS(ep) true
#else
#define EPOCH_CAS(ep) (r_epoch == (ep))
#endif

#ifdef BUG_EPOCH_WRAP
#define BELOW_MAX  true
#define NEXT_EPOCH ((r_epoch % MAX_EPOCH) + 1)     /* a fixed-width counter overflowing */
#else
#define BELOW_MAX  (r_epoch < MAX_EPOCH)
#define NEXT_EPOCH (r_epoch + 1)
#endif

/* guard_holds(write, row, wnow), judged at the time the write read (wnow). For Rotate, ep
 * is expected_epoch and pre preempt_active. */
#define GUARD_HOLDS(k, conn, lid, ep, pre)                                         \
  (  ((k) == W_INSERT && !r_exists)                                               \
  || (((k) == W_RENEW || (k) == W_CLOSE) && r_exists && MATCHES(conn, lid, ep)    \
      && ROW_ACTIVE_AT(wnow))                                                     \
  || ((k) == W_ROTATE && r_exists && EPOCH_CAS(ep) && BELOW_MAX                   \
      && ((pre) || !ROW_ACTIVE_AT(wnow))) )

/* success_epoch(command): the epoch the audit row of a successful write records */
#define AUDIT_EPOCH (k == W_INSERT -> 1 : (k == W_ROTATE -> ep + 1 : ep))

/* holder_refusal(row, now, conn, lid, ep) is None */
#define HOLDER_OK(conn, lid, ep) (r_exists && MATCHES(conn, lid, ep) && ROW_ACTIVE)

/* ---- grant validation: GrantRegistry.recognizes + grant_refusal ----------------------- */
#define RECOGNIZED(g, c) (gr_has[c] && gr_gw[c] == (g) && gr_gen[c] == gen[g])

#ifdef BUG_CACHED_VALIDATE
#define VROW_OK(g, c) (k_exists[g] && k_epoch[g] == gr_epoch[c] && k_lid[g] == gr_lid[c] \
                       && k_conn[g] == (c) && !k_rel[g] && k_exp[g] > now)
#else
#define VROW_OK(g, c) HOLDER_OK(c, gr_lid[c], gr_epoch[c])
#endif

/* Would gateway g accept connector c's grant right now? (the store read and the decision) */
#define VALIDATES(g, c) (RECOGNIZED(g, c) && gr_exp[c] > now && VROW_OK(g, c))
#define ACCEPTED(c)     (VALIDATES(0, c) || VALIDATES(1, c))

/* Coverage only: a recognized, unexpired grant whose epoch a takeover has superseded; a
 * grant the gateway minted before it restarted. */
#define STALE_LIVE(g, c)  (RECOGNIZED(g, c) && gr_exp[c] > now && gr_epoch[c] < r_epoch)
#define PRE_RESTART(g, c) (gr_has[c] && gr_gw[c] == (g) && gr_gen[c] != gen[g])

/* The ground truth an accepted grant must agree with. */
#define CURRENT(c) (r_exists && gr_epoch[c] == r_epoch && gr_lid[c] == r_lid && r_conn == (c) \
                    && ROW_ACTIVE && gr_epoch[c] == hi_epoch)

/* monitor: how many connectors some gateway would validate right now */
#define NVALID (ACCEPTED(0) + ACCEPTED(1))

#define ONE_PAIR (!(ACCEPTED(0) && ACCEPTED(1)) \
                  || (gr_epoch[0] == gr_epoch[1] && gr_lid[0] == gr_lid[1]))

#define INVARIANT ((!ACCEPTED(0) || CURRENT(0)) && (!ACCEPTED(1) || CURRENT(1)) \
                   && ONE_PAIR && NVALID <= 1)

/* State canonicalization (see README, "Abstractions"): values that can never be used
 * again are zeroed so that equivalent states coincide.
 *  - A handle is dead once the row no longer names it as an active lease: lease ids are
 *    never reused, a released or expired lease never becomes active again without a new
 *    lease id, so every later heartbeat, release or grant issue with it is refused.
 *  - A grant is dead once it has expired: the registry prunes it and grant_refusal
 *    refuses it first (GRANT_EXPIRED) in every variant of the model. */
inline bury_handles() {
  if
  :: h_has[0] && !HOLDER_OK(0, h_lid[0], h_epoch[0]) -> h_has[0] = 0; h_epoch[0] = 0; h_lid[0] = 0
  :: else -> skip
  fi;
  if
  :: h_has[1] && !HOLDER_OK(1, h_lid[1], h_epoch[1]) -> h_has[1] = 0; h_epoch[1] = 0; h_lid[1] = 0
  :: else -> skip
  fi
}

inline bury_grants() {
  if
  :: gr_has[0] && gr_exp[0] <= now ->
       gr_has[0] = 0; gr_gw[0] = 0; gr_gen[0] = 0; gr_epoch[0] = 0; gr_lid[0] = 0; gr_exp[0] = 0
  :: else -> skip
  fi;
  if
  :: gr_has[1] && gr_exp[1] <= now ->
       gr_has[1] = 0; gr_gw[1] = 0; gr_gen[1] = 0; gr_epoch[1] = 0; gr_lid[1] = 0; gr_exp[1] = 0
  :: else -> skip
  fi
}

/* ---- narrative for trail replays -------------------------------------------------------
 * printf runs only when spin replays a counterexample (spin -T -t); the verifier ignores
 * it. -T keeps the pieces of one line together. */
inline say_op() {
  if
  :: k == W_INSERT -> printf("acquire")
  :: k == W_RENEW  -> printf("heartbeat(epoch %d, lease %d)", ep, lid)
  :: k == W_CLOSE  -> printf("release(epoch %d, lease %d)", ep, lid)
  :: k == W_ROTATE -> printf("takeover(expected epoch %d, preempt %d)", ep, pre)
  fi
}

inline say_row() {
  printf("row: epoch %d, lease %d, holder C%d, expires t=%d, released %d",
         r_epoch, r_lid, r_conn, r_exp, r_rel)
}

inline say_step() {
  printf("t=%d G%d for C%d: ", now, g, c); say_op()
}

/* ---- the store's atomic write step ---------------------------------------------------- */

/* apply_write(write, row, now), plus the audit append and the ghost checks (A3).
 * Runs inside the caller's atomic block, only where GUARD_HOLDS. */
inline apply_write() {
  if
  :: k == W_INSERT ->
       lid = next_lid; next_lid++;
       r_exists = 1; r_epoch = 1; r_lid = lid; r_conn = c; r_exp = wnow + LEASE_TTL; r_rel = 0
  :: k == W_RENEW || k == W_CLOSE ->
       /* A5: a renewal or release commits only if nobody saw this lease expired first */
       assert(!exp_seen);
       if :: k == W_RENEW -> r_exp = wnow + LEASE_TTL :: else -> r_rel = 1 fi
  :: k == W_ROTATE ->
       lid = next_lid; next_lid++;
       r_epoch = NEXT_EPOCH; r_lid = lid; r_conn = c; r_exp = wnow + LEASE_TTL; r_rel = 0
  fi;
  exp_seen = 0;                     /* a new or renewed lease, or a released one: canonical */
  ev_committed[g] = 1;
  say_step(); printf(": COMMITTED, "); say_row(); printf("\n");
  assert(r_epoch >= hi_epoch && r_epoch <= MAX_EPOCH); /* A3: never backwards, never wraps  */
  assert(k != W_ROTATE || r_epoch == hi_epoch + 1);   /* A3: a takeover is exactly +1      */
  assert(r_epoch == AUDIT_EPOCH);                     /* A3: the audit row tells the truth */
  hi_epoch = r_epoch;
  bury_handles()                    /* grants only die by time: see the Clock */
}

/* LeaseStore.apply with faults: the connection may drop before the store applies the
 * write, or the write may commit and its reply be lost. Either way: RES_LOST. */
inline store_apply() {
#ifdef BUG_CLOCK_BEFORE_LOCK
  wnow = now;                       /* BUG: read the clock ...                           */
  if :: blocked -> say_step(); printf(": read the clock, waits for the row lock\n")
     :: else -> skip fi;
  !blocked;                         /* ... then wait for the row lock: wnow goes stale   */
#else
  !blocked;                         /* wait for the row lock (atomicity is lost here)    */
  wnow = now;                       /* read the clock holding it                         */
#endif
  if
  :: faults < MAX_FAULTS -> faults++; res = RES_LOST;          /* dropped before commit */
       say_step(); printf(": connection dropped before commit; outcome unknown\n")
  :: GUARD_HOLDS(k, c, lid, ep, pre) ->
       apply_write();
       if
       :: res = RES_OK
       :: faults < MAX_FAULTS -> faults++; res = RES_LOST;     /* committed, reply lost */
            printf("      ... and G%d's reply was lost; outcome unknown to G%d\n", g, g)
       fi
  :: !GUARD_HOLDS(k, c, lid, ep, pre) -> res = RES_FAIL;
       if
       :: k == W_RENEW && exp_seen && r_lid == lid ->
            REACH(10)               /* a renewal refused: its lease was seen expired */
       :: else -> skip
       fi;
       say_step(); printf(": refused by the store's guard\n")
  fi;
  wnow = 0                          /* canonical: the time read is used up */
}

/* An unlocked read (Load, validate) of the row at `now`: note whether it saw the current
 * lease expired (A5). Noted only while the Blocker holds the row lock: a write is atomic
 * once it holds the lock, so only a write waiting for the lock can carry a time read before
 * an observation (and only in the broken order). Not noting the others keeps the ghost
 * from splitting every expired state in two. */
inline observe() {
  if
  :: blocked && r_exists && !r_rel && r_exp <= now && !exp_seen -> exp_seen = 1;
       printf("t=%d G%d reads the row: lease %d EXPIRED (expires t=%d)\n", now, g, r_lid, r_exp)
  :: r_exists && !r_rel && r_exp <= now && exp_seen -> skip
  :: else -> skip
  fi
}

/* The coordinator's reply to the connector on success (LeaseHandle.of(row)); for
 * heartbeat and release the handle is unchanged. A4: success only if our event committed. */
inline succeed() {
  assert(ev_committed[g]);
  if
  :: (k == W_INSERT || k == W_ROTATE) && HOLDER_OK(c, lid, AUDIT_EPOCH) ->
       h_has[c] = 1; h_epoch[c] = AUDIT_EPOCH; h_lid[c] = lid
  :: else -> skip   /* heartbeat/release keep the handle; a superseded one is dead anyway */
  fi;
  printf("      G%d -> C%d: success (epoch %d, lease %d)\n", g, c, AUDIT_EPOCH, lid)
}

/* A refusal named from a fresh read. A4: only for a write that did not commit. */
inline deny() {
  say_step(); printf(": DENIED after reading "); say_row(); printf("\n");
  assert(!ev_committed[g])
}

inline reset() {
  c = 0; k = 0; ep = 0; lid = 0; pre = 0; res = 0; allowed = 0; ev_committed[g] = 0
}

/* Restart: a new coordinator instance. Every grant it minted is forgotten (new registry);
 * the durable row and epoch are untouched. */
inline restart() {
  gen[g]++; FORGET_ROW();
  printf("t=%d G%d restarts (generation %d): the grants it minted are forgotten\n",
         now, g, gen[g])
}

/* ---- processes ------------------------------------------------------------------------ */

/* A session holding the lease row lock for a while (FOR SHARE in a fenced effect, or any
 * other transaction): guarded writes wait for it, unlocked reads do not. It may take the
 * lock any number of times (no budget: a counter would only duplicate states). */
active proctype Blocker() {
end_free:
  do
  /* Only over an active lease: a lock held while no lease is active delays writes without
   * making any time read stale across an expiry, so it adds states and no behaviour. */
  :: atomic { !blocked && ROW_ACTIVE -> blocked = 1;
              printf("t=%d a session takes the row lock\n", now) }
  :: atomic { blocked -> blocked = 0; printf("t=%d the row lock is released\n", now) }
  od
}

active proctype Clock() {
end_tick:
  do
  :: atomic { now < MAX_TICK -> now++; bury_handles(); bury_grants();
               printf("t=%d (database clock)\n", now) }
  od
}

/* A1, checked in every reachable state: the guard is enabled exactly when it is violated.
 * The locals only give the failure message readable names; they are assigned only in the
 * violating step, so they add no states. */
active proctype Monitor() {
  bool accepted0, accepted1, current0, current1, one_pair;
  byte nvalid;

end_watch:
  atomic {
    !(INVARIANT) ->
      accepted0 = ACCEPTED(0); accepted1 = ACCEPTED(1);
      current0 = CURRENT(0); current1 = CURRENT(1);
      one_pair = ONE_PAIR; nvalid = NVALID;
      printf("MONITOR t=%d: ", now); say_row(); printf(", highest epoch %d\n", hi_epoch);
      printf("MONITOR C0 grant: epoch %d, lease %d, by G%d gen %d, expires t=%d: accepted %d\n",
             gr_epoch[0], gr_lid[0], gr_gw[0], gr_gen[0], gr_exp[0], accepted0);
      printf("MONITOR C1 grant: epoch %d, lease %d, by G%d gen %d, expires t=%d: accepted %d\n",
             gr_epoch[1], gr_lid[1], gr_gw[1], gr_gen[1], gr_exp[1], accepted1);
      assert(!accepted0 || current0);   /* a grant accepted now names the current lease */
      assert(!accepted1 || current1);
      assert(one_pair);                 /* no two (epoch, lease id) pairs valid at once   */
      assert(nvalid <= 1)               /* at most one connector can pass validation now  */
  }
}

proctype Gateway(byte g) {
  byte c, k, ep, lid, res, wnow;
  bool pre, allowed;

end_idle:
  if
  /* -- acquire: optimistic insert-only write, no read first (coordinator._lifecycle) -- */
  :: atomic {
       if :: c = 0 :: c = 1 fi;
       k = W_INSERT; ep = 1;
       store_apply();
       if :: res == RES_OK -> succeed(); reset(); goto end_idle :: else -> skip fi
     };
     goto outcome

  /* -- takeover: read first (the policy is told the current state), then CAS ---------- */
  :: atomic {
       if :: c = 0 :: c = 1 fi;
       k = W_ROTATE;
       REMEMBER_ROW(); observe();
       /* the caller's expected_epoch: any epoch, current or stale */
       ep = 1;
       do :: ep < MAX_EPOCH -> ep++ :: break od;
       /* The policy allows everything (the most permissive policy; a denial writes no row).
        * preempt_active = verdict.allowed and state is ACTIVE. */
       pre = ROW_ACTIVE;
       /* refusal(Takeover): missing, epoch mismatch, exhausted, preemption denied */
       if
       :: !r_exists || r_epoch != ep -> reset(); goto end_idle  /* missing / epoch mismatch */
       :: r_exists && r_epoch == ep && !BELOW_MAX ->
            REACH(1);                               /* refused at the maximum epoch */
            reset(); goto end_idle
       :: r_exists && r_epoch == ep && BELOW_MAX && pre ->
            REACH(2)                                /* a preempting takeover */
       :: r_exists && r_epoch == ep && BELOW_MAX && !pre -> skip
       fi;
       say_step(); printf(": read "); say_row(); printf("; proceeds to the CAS\n")
     };
     goto apply

  /* -- heartbeat: full-match renew of an active lease, optimistic -------------------- */
  :: atomic {
       if :: h_has[0] -> c = 0 :: h_has[1] -> c = 1 fi;
       k = W_RENEW; ep = h_epoch[c]; lid = h_lid[c];
       store_apply();
       if :: res == RES_OK -> succeed(); reset(); goto end_idle :: else -> skip fi
     };
     goto outcome

  /* -- release: full-match close of an active lease; keeps the epoch ------------------ */
  :: atomic {
       if :: h_has[0] -> c = 0 :: h_has[1] -> c = 1 fi;
       k = W_CLOSE; ep = h_epoch[c]; lid = h_lid[c];
       store_apply();
       if :: res == RES_OK -> succeed(); reset(); goto end_idle :: else -> skip fi
     };
     goto outcome

  /* -- grant issue: reread the durable lease, then mint a process-local grant --------- */
  :: atomic {
       if :: h_has[0] -> c = 0 :: h_has[1] -> c = 1 fi;
       REMEMBER_ROW(); observe();
       if
       :: HOLDER_OK(c, h_lid[c], h_epoch[c]) ->
            gr_has[c] = 1; gr_gw[c] = g; gr_gen[c] = gen[g];
            gr_epoch[c] = h_epoch[c]; gr_lid[c] = h_lid[c];
            /* grant_expiry: min(now + ttl, row.expires_at) */
            gr_exp[c] = (now + GRANT_TTL < r_exp -> now + GRANT_TTL : r_exp);
            printf("t=%d G%d for C%d: grant issued (epoch %d, lease %d, expires t=%d)\n",
                   now, g, c, gr_epoch[c], gr_lid[c], gr_exp[c])
       :: else -> skip                                   /* denied (audited only) */
       fi;
       reset(); goto end_idle
     }

  /* -- validate: a connector presents its grant (to any gateway) right before acting -- */
  :: atomic {
       if :: gr_has[0] -> c = 0 :: gr_has[1] -> c = 1 fi;
       observe();
       if
       :: VALIDATES(g, c) ->
            /* A2: the adapter may run only for the current, active lease */
            assert(gr_gw[c] == g && gr_gen[c] == gen[g]);
            printf("t=%d G%d: C%d's grant (epoch %d, lease %d) VALIDATED; ",
                   now, g, c, gr_epoch[c], gr_lid[c]);
            say_row(); printf("\n");
            assert(CURRENT(c));
            REACH(3)                                /* a successful validation */
       :: !VALIDATES(g, c) && STALE_LIVE(g, c) ->
            REACH(4)                /* a live grant of a taken-over epoch is refused */
       :: !VALIDATES(g, c) && PRE_RESTART(g, c) ->
            REACH(5)                /* a grant minted before a restart is refused */
       :: else -> skip                                   /* other denials */
       fi;
       reset(); goto end_idle
     }

  /* -- restart between operations ---------------------------------------------------- */
  :: atomic { gen[g] < MAX_RESTARTS -> restart(); goto end_idle }
  fi;

/* The store answered something other than success. */
outcome:
  if
  :: res == RES_FAIL -> goto reload
  :: res == RES_LOST ->
#ifdef BUG_BLIND_RETRY
       goto reload                   /* BUG: retry as if the write had not happened */
#else
       if
       /* Committed(event_id): the audit row exists exactly when the write committed */
       :: atomic { ev_committed[g] ->
            REACH(6);               /* reconciled: it committed, report success */
            printf("t=%d G%d: Committed(event) = yes\n", now, g);
            succeed(); reset(); goto end_idle }
       :: atomic { !ev_committed[g] ->
            REACH(7);               /* reconciled: it did not commit, read and retry */
            printf("t=%d G%d: Committed(event) = no\n", now, g);
            goto reload }
       /* the reconciling read failed too, or the gateway died (it may then restart from
        * idle): the caller gets CommitOutcomeUnknown and the connector learns nothing */
       :: atomic { printf("t=%d G%d -> C%d: CommitOutcomeUnknown\n", now, g, c);
                   reset(); goto end_idle }
       fi
#endif
  fi;

/* Load, then decide() on the fresh snapshot: deny, or try the write again. */
reload:
  atomic {
    REMEMBER_ROW(); observe();
    if
    :: k == W_INSERT -> allowed = !r_exists                 /* else lease_held / takeover_required */
    :: k == W_RENEW || k == W_CLOSE -> allowed = HOLDER_OK(c, lid, ep)
    :: k == W_ROTATE ->
         allowed = r_exists && r_epoch == ep && BELOW_MAX && (pre || !ROW_ACTIVE)
    fi;
    if
    :: !allowed -> deny(); reset(); goto end_idle
    :: allowed && k != W_ROTATE ->
         REACH(8)                   /* a write retried after it was known not to commit */
    :: else -> skip
    fi
  };

apply:
  atomic {
    store_apply();
    if
    :: res == RES_OK -> succeed(); reset(); goto end_idle
    :: res == RES_FAIL && k == W_ROTATE ->
         REACH(9)                   /* a takeover lost the CAS after its read */
    :: else -> skip
    fi
  };
  goto outcome
}

init {
  atomic { run Gateway(0); run Gateway(1) }
}
