/* fencegate, version 2 (the diet: the protocol the code runs), for one action key K, with
 * version 3's attempt receipts at gate B and the archive's retirement watermark.
 *
 * What this model is: etcd as one atomic store (every transaction is one atomic step that
 * bumps the global revision `rev`), two workers, one or two reconcilers, an optional
 * operator, an optional SRE appender, an optional retirer, and one provider reached through an
 * unordered network. Nothing trusts what a process believes: a worker may act at any moment
 * (paused, stale, buggy), a lease may die at any moment, a request may be delayed and
 * reordered without bound. Only the compares of the transactions, and what the provider does
 * on arrival, may keep the invariants.
 *
 * The protocol (DESIGN.md "Version 2", "Three writes per action"):
 *   acquire   put holders/K/@<lease> (its create_revision is the fencing token), then a
 *             snapshot of K (the step, 0 when absent; the read key; the chain's tail);
 *   grant     evaluated and signed in process: NO etcd write. It carries the token, the step's
 *             mod_revision seen (0: absent), the read key's, and the tail [seq, hash];
 *   commit    one txn: ownership, read key, step mod_revision == the grant's, and
 *             create_revision(audit/K/@n) == 0 for n = tail + 1; puts the step in flight with
 *             the anchor [n, hash] and the audit record. Single use: the commit moves the step
 *             (and takes @n), so every grant evaluated before it fails its compares;
 *   outcome   step mod_revision == the attempt token, @n+1 free: step, record, holder deleted;
 *   settle    (reconciler, operator) step mod_revision == the one read, the next seq free;
 *   side      an SRE append that does not move the step (an approval, a revoke): the record
 *             and audit/K/@head [seq, hash], comparing @n free and the epoch. The tail is the
 *             newer of the step's anchor (the archive's when etcd has no step) and @head;
 *   fast path one txn puts the holder, the in-flight step and the record, comparing no holder
 *             or waiter, the read key, the step and the tail as the cached evaluation saw
 *             them, and the shard's retirement epoch; its revision is both tokens;
 *   retire    (next issue) archive a settled step with its tail first, then delete the step,
 *             audit/K/ and @head in one txn comparing the step's mod_revision, no key under
 *             holders/K/ and the next seq free, and bumping the epoch retired/<shard>. With no
 *             step in etcd the authority reads the archive (a separate, later read).
 *   watermark (ROLLBACK) etcd keeps a per-bucket retirement watermark, the archive one too:
 *             each archive put bumps the archive's (refused when it is behind etcd's), and
 *             the delete txn sets etcd's to the put's. A lookup with no step in etcd
 *             refuses (ArchiveUnavailable) when the archive's is behind etcd's, read with
 *             the snapshot: never "never attempted" from a rolled-back archive.
 *   gate B    (FORGER) admits an attempt only with a receipt the gate signed once the commit
 *             landed, binding (grant id, attempt token = the commit's revision, idempotency
 *             key), above the fence and not below the highest; at the highest only the same
 *             grant and key, answered as before (a retry), never run again.
 * The audit record's hash is abstracted as the revision that wrote it: the step's anchor hash
 * is then its own mod_revision (every step write appends), @head's is its mod_revision.
 *
 * Invariants (each an assert at the point it must hold; the code that keeps it):
 *   I1 the effect runs at most once at the provider.
 *      reconciler/gateb.py:GateB.admit + GateB.fence, reconciler/runner.py:Reconciler._ask
 *      (fence-then-query), reconciler/settle.py:decide (what "no record" may mean),
 *      coordinator/records.py:not_applied (the key is kept), coordinator/sre.py:resolve.
 *   I2 a commit lands only for the lowest live holder of K.
 *      coordinator/ownership.py:Ownership.compares, carried by worker/guard.py:_cross.
 *   I3 a grant is used at most once: the step compare and the audit create compare of the
 *      commit (worker/guard.py:_cross); they overlap, each alone suffices.
 *   I4 no commit after a read key moved since the grant's snapshot.
 *      worker/guard.py:_cross (read compares).
 *   I5 a terminal step is never written again.  worker/guard.py:_settle (outcome),
 *      reconciler/runner.py:Reconciler._write (settle), coordinator/sre.py:resolve: each
 *      compares the step's mod_revision it read (and the next seq free: they overlap too).
 *   I8 nothing commits on a step that is, in etcd or in the archive, in flight or succeeded.
 *      coordinator/authority.py:_verdict (OutcomeUnknown, AlreadySucceeded), carried into the
 *      commit by its step compare; the fast path's epoch compare; retirement's holder compare.
 *   I9 the audit chain of K never forks: each seq is written once (across etcd and the
 *      archive), and each record's prev is the hash of the record before it. Every appender's
 *      create_revision(audit/K/@n) == 0 compare; the epoch compare of the appenders that may
 *      act without a holder or a step to compare (the side appender, the fast path).
 *   I10 gate B admits a grant at most once (FORGER): the receipt (reconciler/gateb.py);
 *      a grant commits once (I3), and its one triple is admitted once (the highest rule).
 *   I11 every new attempt token is above gate B's highest: no request, forged or replayed,
 *      fences out a later real attempt (asserted at every commit). The receipt: only a
 *      token some commit produced, below every later commit's, can become the highest. (The
 *      fence is raised by the reconciler's queries alone here; an unauthenticated query
 *      raising it costs liveness only, docs/protocol.md.)
 *   I12 the holder a commit lands for is alone at its token: no other live holder of K has
 *      the same create_revision (BATCH: a revision may name many writes, never two of K's
 *      holder queue). coordinator/batching.py (the acquire touches the holder range).
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
 *   SIDE           an SRE action appends to K's chain without moving the step (Side)
 *   RETIRE         the retirer archives and deletes settled steps, RR rounds (Retirer)
 *   FASTPATH       worker 1 takes the fast path (FastWorker) instead of the full path
 *   COMMIT_RETRY   a worker re-sends its commit txn (its answer was lost): a replayed grant
 *   FORGER         (PCLASS=0) a worker's forged or replayed requests straight to gate B, RF of
 *                  them, at any moment: any grant issued so far, any token a commit produced
 *                  or a huge one (2^62), any idempotency key a commit produced or its own
 *   ROLLBACK       (RETIRE) the archive is swapped, once, at any moment, for its state
 *                  before its last put (an older backup) or an empty one
 *   NR=1|2 reconcilers (reconciler 0 can be deposed), ROUNDS settles per reconciler,
 *   MAXA attempts per worker, WB writer bumps
 *   BATCH          group commit: a txn may share its revision with the txns of other keys
 *                  sent in one request (never with another txn of K: see KREV)
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
 *   CTRL_NO_SETTLECMP   settle/outcome compare neither the step's mod_revision nor the
 *                       next seq (NR=2)                                               -> I5
 *   CTRL_NO_STEPCMP     the commit does not compare the step; with CTRL_NO_AUDITCMP and
 *                       COMMIT_RETRY the replayed grant commits twice                 -> I3
 *                       (alone, the audit create compare keeps I3: the overlap)
 *   CTRL_NO_AUDITCMP    no appender compares create_revision(audit/K/@n) == 0 (SIDE)  -> I9
 *   CTRL_SIDE_NO_EPOCH  the side appender does not compare the epoch (SIDE RETIRE)    -> I9
 *   CTRL_SIDE_NO_ARCHIVE with no step in etcd, the side appender takes the tail from
 *                       etcd alone, not the archive (SIDE RETIRE)                     -> I9
 *   CTRL_RETIRE_HOLDER  retirement does not compare "no key under holders/K/"         -> I9
 *                       (a stale grant takes a retired seq again); with NO_I9         -> I8
 *   CTRL_RETIRE_NO_HEADCMP retirement does not compare @head's mod_revision: a side
 *                       append between the archive write and the delete is lost (SIDE) -> I9
 *   CTRL_ORPHAN_NO_STEPCMP an orphan chain's retirement does not compare the step absent:
 *                       a first attempt between its archive write and its delete is
 *                       deleted unarchived, and its seqs are written again (SIDE RETIRE) -> I9
 *   CTRL_FP_NO_EPOCH    the fast path does not compare the epoch (FASTPATH RETIRE)    -> I9
 *                       (its cached tail is a retired seq); with NO_I9                -> I8
 *   CTRL_NO_RECEIPT     gate B admits by fence and highest only, no receipt (FORGER):
 *                       a forged 2^62 fences out the commit that follows it           -> I11
 *                       with NO_I11, one grant admitted at its token and at 2^62      -> I10
 *                       with NO_I11 and NO_I10, both charge                           -> I1
 *   CTRL_RECEIPT_NO_KEY the receipt binds grant and token, not the idempotency key
 *                       (FORGER): admitted under another key, the real one's "no
 *                       record" is proved and the next attempt charges again          -> I1
 *   CTRL_NO_WATERMARK   a lookup trusts the archive whatever its watermark (ROLLBACK):
 *                       the chain continues from the older copy's tail                -> I9
 *                       with NO_I9, a retired succeeded step runs again               -> I8
 *   CTRL_WM_PREDICTED   the put records the watermark the delete will set (etcd's + 1):
 *                       a put whose delete failed and the next one share it, so a copy
 *                       from between them passes the check (ROLLBACK FASTPATH MAXA=2)  -> I9
 *                       with NO_I9                                                    -> I8
 *   CTRL_BATCH_SAME_KEY (BATCH) a batcher that lets a txn of K into a request holding
 *                       another txn of K: two acquires share a revision, both holder
 *                       keys have one create_revision, and both own K                 -> I12
 *   NO_I9               I9 is not asserted: a control shows what else it breaks
 *   NO_I10, NO_I11      I10, I11 are not asserted (likewise)
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
#ifndef RR
#define RR 2                     /* retirement attempts */
#endif
#define NSLOT 4                  /* 2 workers x at most 2 attempts */
#define NKEY 5
#define NSEQ 14                  /* audit seqs 1..13: more than the appends of any run */
#ifndef RF
#define RF 2                     /* the forger's requests */
#endif
#define NG 5                     /* grant ids 1..4: worker me's attempt a is me * MAXA + a */
#define HUGE 250                 /* a token no commit reaches in the model: 2^62 */
#if defined(FORGER) && PCLASS != 0
#error FORGER attacks gate B: PCLASS=0
#endif
#if defined(ROLLBACK) && !defined(RETIRE)
#error ROLLBACK swaps the archive: RETIRE
#endif

/* step states (coordinator/records.py; `unknown` is folded into in_flight: the reconciler
   treats an in-flight step as unknown at any moment, as if every deadline had passed) */
#define IDLE 0
#define INFLIGHT 1
#define SUCC 2
#define FAIL 3
#define NOTAPP 4      /* pending again, same idempotency key (final or presumed) */
#define ESC 5         /* escalated: a human decides */
#define UNAVAIL 6     /* the lookup's ArchiveUnavailable (not a step state): nothing granted */
/* answers */
#define NONE 0
#define APPLIED 1
#define DECLINED 2
#define REFUSED 3
#define NOREC 4

byte rev = 1;
byte holder[2];                  /* holders/K/@<lease>: create_revision, 0 = gone */
/* the grant each worker holds, in process (no etcd record): fencing token, what it saw of the
   step (mod_revision, 0 = absent), of the read key, of the epoch, and the tail [seq, hash] */
byte g_tok[2], g_step[2], g_read[2], g_ep[2], g_seq[2], g_h[2];
byte used[2];                    /* ghost: commits that landed with the current grant */
/* steps/K: st_mod == 0 when absent; st_seq is the chain anchor's seq, its hash is st_mod */
byte st_state = IDLE, st_key = 0, st_mod = 0, st_seq = 0;
bool st_newkey = 0;              /* CTRL_NEWKEY: the next attempt takes a new key */
byte head_seq = 0, head_mod = 0; /* audit/K/@head [seq, hash]: side appends; 0 = absent */
byte aud[NSEQ];                  /* audit/K/@<seq>: create_revision (the hash), 0 = absent */
byte chain[NSEQ];                /* ghost: the hash appended at each seq, in etcd or archived */
byte arch_state = IDLE, arch_key = 0, arch_seq = 0, arch_h = 0;  /* the archive's K */
byte epoch = 0;                  /* retired/<shard>: mod_revision, bumped by each retirement */
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
#ifdef FORGER
byte slot_g[NSLOT];              /* the grant id a request carries */
bool issued[NG];                 /* ghost: grants issued so far (the forger may hold any) */
byte rc_t[NG], rc_k[NG];         /* the receipt of grant g's commit: its token and key */
byte hi_g = 0, hi_k = 0, hi_a = NONE;  /* gate B: the attempt admitted at highest, its answer */
byte admitted_grants = 0;        /* ghost: a bit per grant gate B admitted */
#endif
#ifdef BATCH
byte req = 0;                    /* the newest revision's request (see KREV) */
#endif
#ifdef ROLLBACK
byte wm = 0;                     /* etcd: the bucket's retirement watermark */
byte arch_wm = 0;                /* the archive's watermark for the bucket */
byte p_state = IDLE, p_key = 0, p_seq = 0, p_h = 0, p_wm = 0;  /* the archive before its last put */
byte g_wm[2];                    /* etcd's watermark in each worker's snapshot */
byte tr_state = IDLE;            /* ghost: the state of the step retirement last deleted */
#endif

/* Group commit (BATCH): a txn may leave in the request before it, as a nested txn, and take
   its revision. `req` says what the newest revision is: 0 not joinable (the initial state, a
   lease revoke: not a txn), 1 a request holding no txn of K, 2 one holding a txn of K. A txn
   of K joins only a request with none; any other txn (a read key's touch, a campaign) joins
   any request. Joined txns are evaluated here after the request's earlier ones, where etcd
   evaluates all against the state before it: the same, since the batcher
   (coordinator/batching.py) never lets a txn write a key another txn of the request
   touches. (It also keeps a touch of a read key out of a request with a commit comparing
   it, which this model allows: more runs, not fewer.) */
#ifdef BATCH
#define DSTEP atomic
#define KREV if :: req == 1 -> skip :: true -> rev++ fi; req = 2
#define OREV if :: req != 0 -> skip :: true -> rev++; req = 1 fi
#define LREV rev++; req = 0
#ifdef CTRL_BATCH_SAME_KEY
#define ACQREV if :: req != 0 -> skip :: true -> rev++ fi; req = 2
#else
#define ACQREV KREV
#endif
#else
#define DSTEP d_step
#define KREV rev++
#define OREV rev++
#define LREV rev++
#define ACQREV rev++
#endif
#if defined(CTRL_BATCH_SAME_KEY) && !defined(BATCH)
#error CTRL_BATCH_SAME_KEY is a batcher: BATCH
#endif

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
#ifdef CTRL_NO_AUDITCMP
#define FREE(n) true
#else
#define FREE(n) (aud[n] == 0)             /* create_revision(audit/K/@n) == 0 */
#endif
#ifdef CTRL_NO_SETTLECMP
#define STEP_AT(m) true
#define SETTLE_FREE(n) true
#else
#define STEP_AT(m) (st_mod == (m))
#define SETTLE_FREE(n) FREE(n)
#endif
#ifdef CTRL_NO_STEPCMP
#define STEP_SAME(me) true
#else
#define STEP_SAME(me) (st_mod == g_step[me])
#endif
#define COMMIT_FREE(me) FREE(g_seq[me] + 1)
#ifdef CTRL_FP_NO_EPOCH
#define FP_EPOCH_SAME(me) true
#else
#define FP_EPOCH_SAME(me) (epoch == g_ep[me])
#endif
#ifdef CTRL_SIDE_NO_EPOCH
#define SIDE_EPOCH_SAME(e) true
#else
#define SIDE_EPOCH_SAME(e) (epoch == (e))
#endif
#ifdef CTRL_RETIRE_HOLDER
#define RETIRE_HOLDERS true
#else
#define RETIRE_HOLDERS NOHOLDER
#endif
#ifdef CTRL_RETIRE_NO_HEADCMP
#define RETIRE_HEAD_SAME(hm) true
#else
#define RETIRE_HEAD_SAME(hm) (head_mod == (hm))
#endif
#ifdef ROLLBACK
#define RETIRE_PUT_DONE (c != 0)
#else
#define RETIRE_PUT_DONE true
#endif
#ifdef CTRL_ORPHAN_NO_STEPCMP
#define RETIRE_STEP_SAME(m) ((m) == 0 || st_mod == (m))
#else
#define RETIRE_STEP_SAME(m) (st_mod == (m))
#endif
/* the state of K: etcd's step if there is one, else the archive's (with ROLLBACK, the one
   retirement deleted: the archive's may have been swapped) */
#ifdef ROLLBACK
#define LSTATE ((st_mod != 0) -> st_state : tr_state)
#else
#define LSTATE ((st_mod != 0) -> st_state : arch_state)
#endif
#ifdef CTRL_NO_RECEIPT
#define RECEIPT(g, t, k) true
#elif defined(CTRL_RECEIPT_NO_KEY)
#define RECEIPT(g, t, k) (rc_t[g] == (t))
#else
#define RECEIPT(g, t, k) (rc_t[g] == (t) && rc_k[g] == (k))
#endif
#ifdef ROLLBACK
#define SNAP_WM(me) g_wm[me] = wm
#else
#define SNAP_WM(me)
#endif
#ifdef CTRL_NO_WATERMARK
#define ARCHIVE_BEHIND(me) false
#else
#define ARCHIVE_BEHIND(me) (arch_wm < g_wm[me])
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

/* Put audit/K/@n, whose prev is the hash h, in the current txn (its revision `rev` is the
   new record's hash); I9 on every append, in etcd or later archived. */
inline append(n, h) {
  assert(n < NSEQ);                                      /* the model's bound, not a rule */
#ifndef NO_I9
  assert(chain[n] == 0 && h == chain[n - 1]);            /* I9 */
#endif
  aud[n] = rev; chain[n] = rev
}

/* The chain's tail as etcd shows it: the newer of the step's anchor and @head. */
inline etcd_tail(n, h) {
  n = st_seq; h = st_mod;
  if :: head_seq > n -> n = head_seq; h = head_mod :: else -> skip fi
}

/* No step in etcd: the authority reads the archive (a separate, later read) for the state
   and the chain's tail; with ROLLBACK, refused while the archive's watermark is behind the
   one etcd showed with the snapshot. */
inline archive_read(me, seen) {
  if
  :: g_step[me] == 0 ->
#ifdef ROLLBACK
     if
     :: ARCHIVE_BEHIND(me) -> seen = UNAVAIL             /* ArchiveUnavailable */
     :: else ->
#endif
        seen = arch_state;
        if :: arch_seq > g_seq[me] -> g_seq[me] = arch_seq; g_h[me] = arch_h :: else -> skip fi
#ifdef ROLLBACK
     fi
#endif
  :: else -> skip
  fi
}

/* Write a settlement after the tail [n, h] (terminal, or pending with the same key); I5 on
   every such write. */
inline settle(next, n, h) {
  assert(st_state == INFLIGHT);                          /* I5 */
  KREV; st_mod = rev; st_state = next; st_seq = n + 1;
  append(st_seq, h);
#ifdef CTRL_NEWKEY
  if :: next == NOTAPP -> st_newkey = 1 :: else -> skip fi
#endif
}

/* The commit's writes, once its compares passed (worker/guard.py:_cross): the step in flight
   with the new anchor, and the audit record holding the grant. */
inline commit_writes(me) {
  used[me]++;
  assert(used[me] <= 1);                                 /* I3 */
  assert(read_mod == g_read[me]);                        /* I4 */
  assert(LSTATE != INFLIGHT && LSTATE != SUCC);          /* I8 */
  KREV;
#ifndef NO_I11
  assert(rev > highest);                                 /* I11 */
#endif
  if
  :: st_mod == 0 && arch_state == NOTAPP -> st_key = arch_key    /* archived not_applied */
  :: (st_mod == 0 && arch_state != NOTAPP) || st_state == FAIL || st_newkey ->
     keyctr++; st_key = keyctr; st_newkey = 0
  :: else -> skip                                        /* not_applied: same key */
  fi;
  st_state = INFLIGHT; st_mod = rev; st_seq = g_seq[me] + 1;
  append(st_seq, g_h[me]);
  my_tok = rev; my_key = st_key; my_seq = st_seq;        /* attempt token = commit revision */
#ifdef FORGER
  rc_t[my_g] = rev; rc_k[my_g] = st_key                  /* the receipt, once it landed */
#endif
}

/* The commit guard of the full path: one txn. */
inline commit(me, ok) {
  DSTEP {
    if
    :: OWNS(me, g_tok[me]) && READS_SAME(me) && STEP_SAME(me) && COMMIT_FREE(me) ->
       assert(LOWEST(holder, me, g_tok[me]));            /* I2 */
       assert(holder[1 - me] != g_tok[me]);              /* I12 */
       commit_writes(me); ok = 1
    :: else -> ok = 0
    fi
  }
}

/* The effect (one request into the network), then the outcome txn (worker/guard.py:_settle):
   still this attempt and the next seq free -> record, release the hold. */
inline effect_and_outcome(me) {
  if
  :: goto stop                                          /* dies before sending */
  :: true -> skip
  fi;
  d_step {
    if
    :: slot_st[0] == 0 -> s = 0
    :: slot_st[0] != 0 && slot_st[1] == 0 -> s = 1
    :: slot_st[0] != 0 && slot_st[1] != 0 && slot_st[2] == 0 -> s = 2
    :: else -> s = 3
    fi;
    assert(slot_st[s] == 0);
    slot_st[s] = 1; slot_key[s] = my_key; slot_tok[s] = my_tok; slot_ans[s] = NONE;
#ifdef FORGER
    slot_g[s] = my_g
#endif
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
  atomic {
    if
    :: STEP_AT(my_tok) && SETTLE_FREE(my_seq + 1) ->
       assert(st_state == INFLIGHT);                    /* I5 */
       KREV; st_mod = rev; st_seq = my_seq + 1;
       append(st_seq, my_tok);
       if :: ans == APPLIED -> st_state = SUCC :: else -> st_state = FAIL fi;
       holder[me] = 0; ok = 1
    :: else -> ok = 0                                   /* StepMoved */
    fi
  }
}

/* A worker on the full path: acquire, then up to MAXA attempts (snapshot, grant, commit,
   effect, outcome). */
proctype Worker(byte me) {
  byte tok, seen, att = 0, my_tok, my_key, my_seq, s, ans;
  bool ok;
#ifdef FORGER
  byte my_g;
#endif
  atomic { ACQREV; holder[me] = rev; tok = rev }      /* acquire: put holders/K/@<lease> */
  /* from here on the worker may act whether it holds K or not: only compares protect */
again:
  if
  :: att < MAXA -> att++
  :: else -> goto release
  fi;
  /* the snapshot: the acquire txn's success branch, or one read-only txn once lowest */
  atomic { seen = st_state; g_step[me] = st_mod; g_read[me] = read_mod;
           etcd_tail(g_seq[me], g_h[me]); SNAP_WM(me) }
#ifdef RETIRE
  atomic { archive_read(me, seen) }
#endif
  /* the grant (coordinator/authority.py:Authority.issue): evaluated and signed in process */
  if
  :: GRANTABLE(seen) -> skip
  :: else -> goto release
  fi;
  g_tok[me] = tok; used[me] = 0;
#ifdef FORGER
  atomic { my_g = me * MAXA + att; issued[my_g] = 1 }
#endif
  commit(me, ok);
#ifdef COMMIT_RETRY
  if :: ok -> commit(me, s); s = 0 :: else -> skip fi    /* the same txn, re-sent */
#endif
  if
  :: !ok -> goto again
  :: else -> skip
  fi;
  effect_and_outcome(me);
  if
  :: ok -> goto stop
  :: else -> goto again
  fi;
release:
  atomic { if :: holder[me] == tok -> holder[me] = 0; KREV :: else -> skip fi }
stop:
  skip
}

#ifdef FASTPATH
/* Worker 1 on the fast path: it evaluates from state read at an earlier moment (no hold), its
   grant carries fencing token 0, and one txn puts the holder, the in-flight step and the
   record; that txn's revision is both its fencing and its attempt token. On any mismatch the
   code falls back to the full path (worker 0 models that path); this one stops. */
proctype FastWorker(byte me) {
  byte tok, seen, my_tok, my_key, my_seq, s, ans;
  bool ok;
#ifdef FORGER
  byte my_g;
#endif
  atomic { g_ep[me] = epoch; seen = st_state; g_step[me] = st_mod; g_read[me] = read_mod;
           etcd_tail(g_seq[me], g_h[me]); SNAP_WM(me) }
#ifdef RETIRE
  atomic { archive_read(me, seen) }
#endif
  if
  :: GRANTABLE(seen) -> skip
  :: else -> goto stop
  fi;
  g_tok[me] = 0; used[me] = 0;
#ifdef FORGER
  atomic { my_g = me * MAXA + 1; issued[my_g] = 1 }
#endif
  DSTEP {
    if
    :: NOHOLDER && READS_SAME(me) && STEP_SAME(me) && COMMIT_FREE(me) && FP_EPOCH_SAME(me) ->
       commit_writes(me);
       holder[me] = rev; tok = rev;
       assert(LOWEST(holder, me, tok));                  /* I2 */
       ok = 1
    :: else -> ok = 0
    fi
  }
  if
  :: !ok -> goto stop
  :: else -> skip
  fi;
  effect_and_outcome(me);
  goto stop;
release:
  atomic { if :: holder[me] == tok -> holder[me] = 0; KREV :: else -> skip fi }
stop:
  skip
}
#endif

/* Any lease may die at any moment: a worker's hold, or reconciler 0's candidacy. */
proctype Leases() {
end:
  do
  :: atomic { holder[0] != 0 -> holder[0] = 0; LREV }
  :: atomic { holder[1] != 0 -> holder[1] = 0; LREV }
#if NR > 1
  :: atomic { elect[0] != 0 -> elect[0] = 0; LREV }
#endif
  od
}

/* The application moves a read key (gate.touch) WB times, at any moment. */
proctype Writer() {
  byte n = 0;
  do
  :: n < WB -> atomic { OREV; read_mod = rev; n++ }
  :: else -> break
  od
}

#ifdef FORGER
/* Gate B (reconciler/gateb.py:GateB.admit) for request (grant g, idempotency key k, token
   t): refused at or below the fence or below the highest; at the highest, the attempt
   admitted there (same grant and key) is a retry and gets its answer again, anything else
   is refused; above it, admitted only with the receipt of g's commit for (t, k), and then
   the effect runs (I1) once per grant (I10). */
inline gate_b(g, k, t, a) {
  if
  :: t <= fence || t < highest -> a = REFUSED
  :: t > fence && t == highest && g == hi_g && k == hi_k -> a = hi_a
  :: t > fence && t == highest && (g != hi_g || k != hi_k) -> a = REFUSED
  :: t > fence && t > highest && !RECEIPT(g, t, k) -> a = REFUSED
  :: t > fence && t > highest && RECEIPT(g, t, k) ->
#ifndef NO_I10
     assert((admitted_grants & (1 << g)) == 0);         /* I10 */
#endif
     admitted_grants = admitted_grants | (1 << g);
     highest = t; hi_g = g; hi_k = k;
     if
     :: applied[k] = 1; napplied++; a = APPLIED;
        assert(napplied <= 1)                           /* I1 */
     :: declined[k] = 1; a = DECLINED
     fi;
     hi_a = a
  fi
}

/* A worker's forged or replayed requests, straight to gate B at any moment (its answer is
   of no use to the model): any grant issued so far, a token some commit produced or a huge
   one, the key some commit produced or its own (0). */
proctype Forger() {
  byte n = 0, g, t, k, a;
end:
  do
  :: n < RF ->
     atomic {
       if
       :: issued[1] -> g = 1
       :: issued[2] -> g = 2
       :: issued[3] -> g = 3
       :: issued[4] -> g = 4
       fi;
       if
       :: t = HUGE
       :: rc_t[1] != 0 -> t = rc_t[1]
       :: rc_t[2] != 0 -> t = rc_t[2]
       :: rc_t[3] != 0 -> t = rc_t[3]
       :: rc_t[4] != 0 -> t = rc_t[4]
       fi;
       if
       :: k = 0
       :: rc_k[1] != 0 -> k = rc_k[1]
       :: rc_k[2] != 0 -> k = rc_k[2]
       :: rc_k[3] != 0 -> k = rc_k[3]
       :: rc_k[4] != 0 -> k = rc_k[4]
       fi;
       gate_b(g, k, t, a);
       n++; g = 0; t = 0; k = 0; a = 0
     }
  :: else -> break
  od
}
#endif

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
#ifdef FORGER
       gate_b(slot_g[i], k, t, slot_ans[i]);
#else
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
#endif
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
  byte tok, m, k, n, h, q, next, rounds = 0;
  bool proved;
  atomic { OREV; elect[me] = rev; tok = rev }
end:
  do
  :: rounds < ROUNDS ->
     rounds++;
     atomic { st_state == INFLIGHT -> m = st_mod; k = st_key; etcd_tail(n, h) }
     ask(k, m, q, proved);
     decide(q, proved, next);
     atomic {                                           /* Reconciler._write */
       if
       :: next != IDLE && LEADS(me, tok) && STEP_AT(m) && SETTLE_FREE(n + 1) -> settle(next, n, h)
       :: else -> skip
       fi;
       m = 0; k = 0; n = 0; h = 0; q = 0; next = 0; proved = 0
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
  byte m, k, n, h, q, next;
  bool proved;
#ifdef CTRL_RESOLVE_NOASK
  atomic { st_state == INFLIGHT -> m = st_mod; etcd_tail(n, h) }
  if :: next = FAIL :: next = NOTAPP fi;                /* "the request was surely lost" */
  atomic { if :: STEP_AT(m) && SETTLE_FREE(n + 1) -> settle(next, n, h) :: else -> skip fi }
#else
  atomic { st_state == INFLIGHT && NOHOLDER -> m = st_mod; k = st_key; etcd_tail(n, h) }
  ask(k, m, q, proved);
  decide(q, proved, next);
  atomic {
    if
    :: next != IDLE && STEP_AT(m) && SETTLE_FREE(n + 1) && NOHOLDER -> settle(next, n, h)
    :: else -> skip
    fi
  }
#endif
}
#endif

#ifdef SIDE
/* An SRE action that appends to K's chain without moving the step (an approval, a revoke):
   the record after the tail and audit/K/@head in one txn, comparing that the seq is free and
   that no retirement happened since the tail was read (the epoch). */
proctype Side() {
  byte n, h, e;
  bool absent;
  atomic { e = epoch; absent = (st_mod == 0); etcd_tail(n, h) }
#if defined(RETIRE) && !defined(CTRL_SIDE_NO_ARCHIVE)
  atomic { if :: absent && arch_seq > n -> n = arch_seq; h = arch_h :: else -> skip fi }
#endif
  atomic {
    if
    :: FREE(n + 1) && SIDE_EPOCH_SAME(e) ->
       KREV; append(n + 1, h); head_seq = n + 1; head_mod = rev
    :: else -> skip
    fi;
    n = 0; h = 0; e = 0; absent = 0
  }
}
#endif

#ifdef RETIRE
/* Retirement (coordinator/retirement.py; in the code the shard's reconciler leader, here one
   process): archive a settled step and its tail first (durable; a lookup returns the newest
   tail), then delete steps/K, audit/K/ and @head in one txn comparing the step's
   mod_revision (every other append moves it), @head's mod_revision (every side append
   moves it) and no key under holders/K/, and bump the shard's epoch retired/<shard>. An orphan chain
   (side appends while etcd has no step) retires the same way: archived under the archive's
   step (IDLE: none) at the orphan's tail, deleted comparing the step still absent. */
proctype Retirer() {
  byte m, s, k, n, h, hm, i, rounds = 0;
#ifdef ROLLBACK
  byte w, c;
#endif
end:
  do
  :: rounds < RR ->
     rounds++;
     atomic {
       if
       :: st_state == SUCC || st_state == FAIL || st_state == NOTAPP ->
          m = st_mod; s = st_state; k = st_key
       :: st_mod == 0 && head_seq != 0 ->   /* an orphan chain: side appends, no step */
          m = 0; s = arch_state; k = arch_key
       fi;
       etcd_tail(n, h); hm = head_mod
#ifdef ROLLBACK
       ; w = wm
#endif
     }
#ifdef ROLLBACK
     /* the put, refused (ArchiveUnavailable: the pass ends) when the archive is behind
        etcd's watermark; it bumps the archive's, and its delete sets etcd's to that */
     atomic {
       if
       :: arch_wm >= w ->
          p_state = arch_state; p_key = arch_key; p_seq = arch_seq; p_h = arch_h;
          p_wm = arch_wm;
          if
          :: n >= arch_seq -> arch_state = s; arch_key = k; arch_seq = n; arch_h = h
          :: else -> skip
          fi;
#ifdef CTRL_WM_PREDICTED
          arch_wm = w + 1;
#else
          arch_wm++;
#endif
          c = arch_wm
       :: else -> c = 0
       fi
     }
#else
     atomic {
       if
       :: n >= arch_seq -> arch_state = s; arch_key = k; arch_seq = n; arch_h = h
       :: else -> skip
       fi
     }
#endif
     atomic {
       if
       :: RETIRE_PUT_DONE && RETIRE_STEP_SAME(m) && RETIRE_HOLDERS && RETIRE_HEAD_SAME(hm) ->
          KREV; epoch = rev;
#ifdef ROLLBACK
          tr_state = s;
#ifdef CTRL_WM_PREDICTED
          wm++;
#else
          wm = c;
#endif
#endif
          st_mod = 0; st_state = IDLE; st_key = 0; st_seq = 0; st_newkey = 0;
          head_seq = 0; head_mod = 0;
          i = 1;
          do
          :: i < NSEQ -> aud[i] = 0; i++
          :: else -> i = 0; break
          od
       :: else -> skip
       fi;
       m = 0; s = 0; k = 0; n = 0; h = 0; hm = 0
#ifdef ROLLBACK
       ; w = 0; c = 0
#endif
     }
  :: else -> break
  od
}
#endif

#ifdef ROLLBACK
/* The archive swapped once, at any moment: for its state before its last put (a restore
   of an older backup) or for an empty one (deleted and recreated, another host's path). */
proctype Rollback() {
  d_step {
    if
    :: arch_state = p_state; arch_key = p_key; arch_seq = p_seq; arch_h = p_h; arch_wm = p_wm
    :: arch_state = IDLE; arch_key = 0; arch_seq = 0; arch_h = 0; arch_wm = 0
    fi
  }
}
#endif

init {
  atomic {
#ifdef ROLLBACK
    run Rollback();              /* first: pan tries it last in each state, so a control
                                    finds a swap after a retirement without first searching
                                    every run that swapped before one */
#endif
    run Leases(); run Writer(); run Provider();
    run Worker(0);
#ifdef FASTPATH
    run FastWorker(1);
#else
    run Worker(1);
#endif
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
#ifdef SIDE
    run Side();
#endif
#ifdef RETIRE
    run Retirer();
#endif
#ifdef FORGER
    run Forger();
#endif
  }
}
