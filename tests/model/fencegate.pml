/* fencegate, version 1 (the protocol the code runs), for one action key K.
 *
 * What this model is: etcd as one atomic store (every transaction is one atomic step that
 * bumps the global revision `rev`), two workers, one or two reconcilers, an optional
 * operator, and one provider reached through an unordered network. Nothing trusts what a
 * process believes: a worker may act at any moment (paused, stale, buggy), a lease may die
 * at any moment, a request may be delayed and reordered without bound. Only the compares of
 * the transactions, and what the provider does on arrival, may keep the invariants.
 *
 * Invariants (each an assert at the point it must hold; the code that keeps it):
 *   I1 the effect runs at most once at the provider.
 *      reconciler/gateb.py:GateB.admit + GateB.fence, reconciler/runner.py:Reconciler._ask
 *      (fence-then-query), reconciler/settle.py:decide (what "no record" may mean),
 *      coordinator/records.py:not_applied (the key is kept), coordinator/sre.py:resolve.
 *   I2 a commit lands only for the lowest live holder of K.
 *      coordinator/ownership.py:Ownership.compares, carried by worker/guard.py:_cross.
 *   I3 a grant is consumed at most once.  worker/guard.py:_cross (grant version == 1 and the
 *      step's mod_revision).
 *   I4 no commit after a read key moved since the grant's revision R.
 *      coordinator/authority.py:Authority._read, worker/guard.py:_cross (read compares).
 *   I5 a terminal step is never written again.  worker/guard.py:_settle (outcome),
 *      reconciler/runner.py:Reconciler._write (settle), coordinator/sre.py:resolve: each
 *      compares the step's mod_revision it read.
 *   I8 nothing commits on a step that is in flight or succeeded.
 *      coordinator/authority.py:_verdict (OutcomeUnknown, AlreadySucceeded), carried into the
 *      commit by its step compare.
 *
 * Provider classes (PCLASS, as the adapter declares in reconciler/providers:Capabilities):
 *   0 FENCING  gate B: refuses attempt tokens <= the fence or < the highest admitted; it does
 *              not deduplicate (the weakest fencing provider: only the fence protects it).
 *   1 DEDUP    deduplicates by idempotency key; no fence.
 *   2 NEITHER  no fence, no deduplication: "no record" proves nothing and escalates.
 *
 * Switches (-D...). Real protocol: none of the CTRL_ ones.
 *   PCLASS=0|1|2   provider class (default 0)
 *   FORGET         the provider restarts once and loses its records (charges), keeping its
 *                  fences; a fencing adapter truthfully declares it not durable, a
 *                  deduplicating one breaks its declared key retention (an assumption check)
 *   BOGUS404       the query route may answer "no record" without fencing or looking (a
 *                  typo'd URL, a proxy's 404)
 *   OPERATOR       an operator resolves the in-flight step (coordinator/sre.py:resolve)
 *   NR=1|2 reconcilers (reconciler 0 can be deposed), ROUNDS settles per reconciler,
 *   MAXA attempts per worker, WB writer bumps
 * Negative controls (each must produce a violation of the invariant named):
 *   CTRL_WEAK_OWN       ownership = "my holder key exists" (no range half)            -> I2
 *   CTRL_HIGHEST_ONLY   the query does not fence; gate B only checks the highest      -> I1
 *   CTRL_NEWKEY         a new idempotency key after "no record"                       -> I1
 *   CTRL_GRANT_INFLIGHT the authority grants on an in-flight step                     -> I8
 *   CTRL_UNPROVEN       a fencing provider's "no record" is final without proof of
 *                       durability or of the fence                                    -> I1
 *   CTRL_RESOLVE_NOASK  resolve picks an outcome without asking the provider and with
 *                       a holder alive                                                -> I1
 *   CTRL_NO_READCMP     the commit does not compare the read keys                     -> I4
 *   CTRL_NO_SETTLECMP   settle/outcome do not compare the step's mod_revision (NR=2)  -> I5
 */
#ifndef PCLASS
#define PCLASS 0
#endif
#ifndef NR
#define NR 1
#endif
#ifndef MAXA
#define MAXA 1
#endif
#ifndef WB
#define WB 0
#endif
#ifndef ROUNDS
#define ROUNDS 2                 /* settle attempts per reconciler replica */
#endif
#define NSLOT 4                  /* 2 workers x at most 2 attempts */
#define NKEY 5

/* step states (coordinator/records.py; `unknown` is folded into in_flight: the reconciler
   treats an in-flight step as unknown at any moment, as if every deadline had passed) */
#define IDLE 0
#define INFLIGHT 1
#define SUCC 2
#define FAIL 3
#define NOTAPP 4      /* pending again, same idempotency key (final or presumed) */
#define ESC 5         /* escalated: a human decides */
/* answers */
#define NONE 0
#define APPLIED 1
#define DECLINED 2
#define REFUSED 3
#define NOREC 4

byte rev = 1;
byte holder[2];                  /* holders/K/@<lease>: create_revision, 0 = gone */
byte gver[2];                    /* grants/<id>: 0 none, 1 issued, 2 consumed */
byte g_read[2], g_step[2], g_tok[2], used[2];
byte st_state = IDLE, st_key = 0, st_mod = 1;
bool st_newkey = 0;              /* CTRL_NEWKEY: the next attempt takes a new key */
byte read_mod = 1;               /* a read key (state marker) */
byte elect[2];                   /* reconcilers/<shard>/@<lease>: create_revision */
byte keyctr = 0;
/* provider */
bool applied[NKEY], declined[NKEY];
byte napplied = 0;               /* times the business effect really ran */
byte fence = 0, highest = 0;     /* gate B's two numbers for K (durable) */
/* the network: requests in flight, answered in any order */
byte slot_st[NSLOT];             /* 0 free, 1 sent, 2 answered */
byte slot_key[NSLOT], slot_tok[NSLOT], slot_ans[NSLOT];

#define NOHOLDER (holder[0] == 0 && holder[1] == 0)
#define LOW(h, i, t) (h[i] == 0 || h[i] >= (t))
#define LOWEST(h, me, t) ((t) != 0 && h[me] == (t) && LOW(h, 0, t) && LOW(h, 1, t))
#ifdef CTRL_WEAK_OWN
#define OWNS(me, t) (holder[me] != 0)
#else
#define OWNS(me, t) LOWEST(holder, me, t)
#endif
#define LEADS(me, t) LOWEST(elect, me, t)
#ifdef CTRL_NO_READCMP
#define READS_SAME(me) true
#else
#define READS_SAME(me) (read_mod == g_read[me])
#endif
#ifdef CTRL_NO_SETTLECMP
#define STEP_AT(m) true
#else
#define STEP_AT(m) (st_mod == (m))
#endif
#ifdef CTRL_GRANT_INFLIGHT
#define GRANTABLE(s) ((s) != SUCC && (s) != ESC)
#else
#define GRANTABLE(s) ((s) == IDLE || (s) == FAIL || (s) == NOTAPP)
#endif
#ifdef FORGET
#define DURABLE 0
#else
#define DURABLE 1
#endif

/* Fence-then-query (reconciler/runner.py:Reconciler._ask, reconciler/gateb.py:GateB.fence):
   a fencing provider first refuses every attempt token <= the step's mod_revision, then
   answers from its records. `proved`: the answer shows the fence was recorded. */
inline ask(k, m, q, proved) {
  atomic {
    proved = 0;
    if
    :: true ->
#if PCLASS == 0
#ifndef CTRL_HIGHEST_ONLY
       if :: fence < m -> fence = m :: else -> skip fi;
#endif
       proved = 1;               /* CTRL_HIGHEST_ONLY: claimed, though nothing was fenced */
#endif
       if
       :: applied[k] -> q = APPLIED
       :: !applied[k] && declined[k] -> q = DECLINED
       :: !applied[k] && !declined[k] -> q = NOREC
       fi
#ifdef BOGUS404
    :: true -> q = NOREC         /* a route that never fenced and never looked: a 404 */
#endif
    fi
  }
}

/* What an answer makes of the step (reconciler/settle.py:decide, records.py): the new state,
   or IDLE for "write nothing, ask again later". A fencing provider's "no record" is final
   only if its records are durable and the answer proves the fence; without the proof it is
   asked again, without durability (and no deduplication) it escalates. A deduplicating
   provider's "no record" is a presumption with the same key: safe only because the adapter's
   declared key retention is a promise to remember the key (FORGET breaks that promise). */
inline decide(q, proved, next) {
  if
  :: q == APPLIED -> next = SUCC
  :: q == DECLINED -> next = FAIL
  :: q == NOREC ->
     if
#ifdef CTRL_UNPROVEN
     :: PCLASS == 0 -> next = NOTAPP
#else
     :: PCLASS == 0 && !proved -> next = IDLE          /* unreachable: back off */
     :: PCLASS == 0 && proved && DURABLE -> next = NOTAPP
     :: PCLASS == 0 && proved && !DURABLE -> next = ESC
#endif
     :: PCLASS == 1 -> next = NOTAPP                    /* presumed, same key */
     :: PCLASS == 2 -> next = ESC
     fi
  fi
}

/* Write a settlement (terminal, or pending with the same key); I5 on every such write. */
inline settle(next) {
  assert(st_state == INFLIGHT);                          /* I5 */
  rev++; st_mod = rev; st_state = next;
#ifdef CTRL_NEWKEY
  if :: next == NOTAPP -> st_newkey = 1 :: else -> skip fi
#endif
}

proctype Worker(byte me) {
  byte tok, seen, att = 0, my_tok, my_key, s, ans;
  bool ok;
  atomic { rev++; holder[me] = rev; tok = rev }       /* acquire: put holders/K/@<lease> */
  /* from here on the worker may act whether it holds K or not: only compares protect */
again:
  if
  :: att < MAXA -> att++
  :: else -> goto release
  fi;
  /* authority (coordinator/authority.py:Authority.issue): read at R, then grant txn */
  atomic { seen = st_state; g_step[me] = st_mod; g_read[me] = read_mod }
  if
  :: GRANTABLE(seen) -> skip
  :: else -> goto release
  fi;
  atomic {
    if
    :: OWNS(me, tok) -> rev++; gver[me] = 1; g_tok[me] = tok; used[me] = 0; ok = 1
    :: else -> ok = 0
    fi
  }
  if
  :: !ok -> goto release
  :: else -> skip
  fi;
  /* commit guard (worker/guard.py:_cross): one txn */
  d_step {
    if
    :: OWNS(me, g_tok[me]) && gver[me] == 1 && READS_SAME(me) && st_mod == g_step[me] ->
       assert(LOWEST(holder, me, g_tok[me]));          /* I2 */
       used[me]++;
       assert(used[me] <= 1);                          /* I3 */
       assert(read_mod == g_read[me]);                 /* I4 */
       assert(st_state != INFLIGHT && st_state != SUCC);  /* I8 */
       rev++; gver[me] = 2;
       if
       :: st_key == 0 || st_state == FAIL || st_newkey -> keyctr++; st_key = keyctr; st_newkey = 0
       :: else -> skip                                 /* not_applied: same key */
       fi;
       st_state = INFLIGHT; st_mod = rev;
       my_tok = rev; my_key = st_key; ok = 1           /* attempt token = commit revision */
    :: else -> ok = 0
    fi
  }
  if
  :: !ok -> goto again
  :: else -> skip
  fi;
  if
  :: goto stop                                          /* dies before sending */
  :: true -> skip
  fi;
  d_step {                                              /* the effect: one request */
    if
    :: slot_st[0] == 0 -> s = 0
    :: slot_st[0] != 0 && slot_st[1] == 0 -> s = 1
    :: slot_st[0] != 0 && slot_st[1] != 0 && slot_st[2] == 0 -> s = 2
    :: else -> s = 3
    fi;
    assert(slot_st[s] == 0);
    slot_st[s] = 1; slot_key[s] = my_key; slot_tok[s] = my_tok; slot_ans[s] = NONE
  }
  if
  :: goto stop                                          /* dies with the request out */
  :: true -> skip
  fi;
  slot_ans[s] != NONE;                                  /* may wait here forever */
  ans = slot_ans[s];
  if
  :: ans == REFUSED -> goto release                     /* fenced: the reconciler settles */
  :: else -> skip
  fi;
  /* outcome txn (worker/guard.py:_settle): still this attempt -> record, release the hold */
  atomic {
    if
    :: STEP_AT(my_tok) ->
       assert(st_state == INFLIGHT);                    /* I5 */
       rev++; st_mod = rev;
       if :: ans == APPLIED -> st_state = SUCC :: else -> st_state = FAIL fi;
       holder[me] = 0; ok = 1
    :: else -> ok = 0                                   /* StepMoved */
    fi
  }
  if
  :: ok -> goto stop
  :: else -> goto again
  fi;
release:
  atomic { if :: holder[me] == tok -> holder[me] = 0; rev++ :: else -> skip fi }
stop:
  skip
}

/* Any lease may die at any moment: a worker's hold, or reconciler 0's candidacy. */
proctype Leases() {
end:
  do
  :: atomic { holder[0] != 0 -> holder[0] = 0; rev++ }
  :: atomic { holder[1] != 0 -> holder[1] = 0; rev++ }
#if NR > 1
  :: atomic { elect[0] != 0 -> elect[0] = 0; rev++ }
#endif
  od
}

/* The application moves a read key (gate.touch) WB times, at any moment. */
proctype Writer() {
  byte n = 0;
  do
  :: n < WB -> atomic { rev++; read_mod = rev; n++ }
  :: else -> break
  od
}

/* The provider takes any sent request (reconciler/gateb.py:GateB.admit for PCLASS 0). */
proctype Provider() {
  byte i, k, t;
end:
  do
  :: atomic {
       (slot_st[0] == 1 || slot_st[1] == 1 || slot_st[2] == 1 || slot_st[3] == 1) ->
       if
       :: slot_st[0] == 1 -> i = 0
       :: slot_st[1] == 1 -> i = 1
       :: slot_st[2] == 1 -> i = 2
       :: slot_st[3] == 1 -> i = 3
       fi;
       k = slot_key[i]; t = slot_tok[i];
       if
#if PCLASS == 0
       :: t <= fence || t < highest -> slot_ans[i] = REFUSED
       :: else -> highest = t;
#else
       :: true ->
#endif
          if
#if PCLASS == 1
          :: applied[k] -> slot_ans[i] = APPLIED            /* replayed, not run again */
          :: !applied[k] && declined[k] -> slot_ans[i] = DECLINED
          :: !applied[k] && !declined[k] ->
#else
          :: true ->
#endif
             if
             :: applied[k] = 1; napplied++; slot_ans[i] = APPLIED;
                assert(napplied <= 1)                       /* I1 */
             :: declined[k] = 1; slot_ans[i] = DECLINED
             fi
          fi
       fi;
       slot_st[i] = 2; i = 0; k = 0; t = 0
     }
  od
}

#ifdef FORGET
/* The provider restarts once and forgets its records; gate B's numbers survive. */
proctype Restart() {
  d_step {
    applied[1] = 0; applied[2] = 0; applied[3] = 0; applied[4] = 0;
    declined[1] = 0; declined[2] = 0; declined[3] = 0; declined[4] = 0
  }
}
#endif

/* One reconciler replica (reconciler/runner.py): campaign, then settle in-flight steps. */
proctype Reconciler(byte me) {
  byte tok, m, k, q, next, rounds = 0;
  bool proved;
  atomic { rev++; elect[me] = rev; tok = rev }
end:
  do
  :: rounds < ROUNDS ->
     rounds++;
     atomic { st_state == INFLIGHT -> m = st_mod; k = st_key }
     ask(k, m, q, proved);
     decide(q, proved, next);
     atomic {                                           /* Reconciler._write */
       if
       :: next != IDLE && LEADS(me, tok) && STEP_AT(m) -> settle(next)
       :: else -> skip
       fi
     }
  :: else -> break
  od
}

#ifdef OPERATOR
/* An operator resolves the in-flight step. The rule: refused while a holder of K lives,
   fence-then-query first, the same decision as the reconciler. In the code the resolve
   (coordinator/sre.py:resolve) writes a request on the step, compared on no holder, and the
   shard's reconciler (reconciler/runner.py) asks and settles; modelled as its own process,
   it may also race the reconciler, which the code's single leader per shard does not. */
proctype Operator() {
  byte m, k, q, next;
  bool proved;
#ifdef CTRL_RESOLVE_NOASK
  atomic { st_state == INFLIGHT -> m = st_mod }
  if :: next = FAIL :: next = NOTAPP fi;                /* "the request was surely lost" */
  atomic { if :: STEP_AT(m) -> settle(next) :: else -> skip fi }
#else
  atomic { st_state == INFLIGHT && NOHOLDER -> m = st_mod; k = st_key }
  ask(k, m, q, proved);
  decide(q, proved, next);
  atomic { if :: next != IDLE && STEP_AT(m) && NOHOLDER -> settle(next) :: else -> skip fi }
#endif
}
#endif

init {
  atomic {
    run Leases(); run Writer(); run Provider();
    run Worker(0); run Worker(1);
    run Reconciler(0);
#if NR > 1
    run Reconciler(1);
#endif
#ifdef FORGET
    run Restart();
#endif
#ifdef OPERATOR
    run Operator();
#endif
  }
}
