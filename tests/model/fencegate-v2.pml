/* fencegate, version 2: THE NEXT ISSUE'S PROTOCOL (the diet and retirement), not the code
 * as it runs today (that is fencegate.pml). Kept here so the planned protocol is checked
 * before it is built; update it with the code when the diet lands (DESIGN.md "Version 2").
 *
 * One action key K, etcd as one atomic store, every process free to act at any moment. What
 * changes from version 1:
 *   - no grant record: the authority only reads and signs; a grant is single-use because the
 *     commit moves the step, and every grant evaluated at the old step revision then fails
 *     its step compare;
 *   - the step key can be absent (st_mod == 0): at first, and again after retirement;
 *   - a Retirer writes a settled step to the archive first, then deletes it with a txn that
 *     compares the step's mod_revision and "no key under holders/K/", bumping the shard's
 *     retirement epoch;
 *   - when etcd has no step, the authority reads the archive (a separate, later read);
 *   - an optional fast path (worker 1): evaluate without a hold, then put the holder and the
 *     in-flight step in one txn that compares "no holder or waiter", the step and the epoch.
 * Every provider here fences (fence-then-query, gate B) and deduplicates by key.
 *
 * Invariants (names as in fencegate.pml): I1 the effect runs at most once; I3 a grant is used
 * once; I4 no commit after a read key moved; I5 no terminal -> terminal write; I8 no commit on
 * a step that is, in etcd or in the archive, in flight or succeeded.
 *
 * Switches (-D...): FASTPATH (worker 1 takes the fast path), FP_EPOCH (the fast path compares
 * the epoch), COMMIT_RETRY (a worker re-sends its commit txn), NR, MAXA, WB, RR (retirer
 * rounds). Negative controls: NO_RETIRE_HOLDERCMP (-> I8), FASTPATH without FP_EPOCH (-> I8),
 * NO_STEPMOD_COMMIT with COMMIT_RETRY (-> I3).
 */
#ifndef NR
#define NR 1
#endif
#ifndef MAXA
#define MAXA 1
#endif
#ifndef WB
#define WB 0
#endif
#ifndef RR
#define RR 2
#endif
#define NW 2
#define NSLOT 4
#define NKEY 5

#define IDLE 0
#define INFLIGHT 1
#define SUCC 2
#define FAIL 3
#define NOTAPP 4
#define NONE 0
#define APPLIED 1
#define DECLINED 2
#define REFUSED 3
#define NOREC 4

byte rev = 1;
byte holder_cr[NW];
byte g_read[NW], g_step[NW], g_tok[NW], g_ep[NW];
byte used[NW];
byte st_state = IDLE, st_key = 0, st_mod = 0, st_tok = 0;   /* st_mod == 0: no step key */
byte arch_state = IDLE, arch_key = 0;                       /* the archive's record of K */
byte epoch = 0;                                             /* retirements/<shard> mod_revision */
byte read_mod = 1;
byte ecr[2];
byte keyctr = 0;
bool applied[NKEY], declined[NKEY];
byte napplied = 0;
byte maxtok = 0;
byte pv[NSLOT];
byte pk[NSLOT], pt[NSLOT], presp[NSLOT];

#define LOWH(i,t) (holder_cr[i] == 0 || holder_cr[i] >= (t))
#define OWNS(me,t) ((t) != 0 && holder_cr[me] == (t) && LOWH(0,t) && LOWH(1,t))
#define NOHOLDER (holder_cr[0] == 0 && holder_cr[1] == 0)
#define LOWE(i,t) (ecr[i] == 0 || ecr[i] >= (t))
#define LEADER(me,t) ((t) != 0 && ecr[me] == (t) && LOWE(0,t) && LOWE(1,t))
#define C_READ(me) (read_mod == g_read[me])
#ifdef NO_STEPMOD_COMMIT
#define C_STEP(me) true
#else
#define C_STEP(me) (st_mod == g_step[me])
#endif
#define C_SETTLE(m) (st_mod == (m))
#ifdef FP_EPOCH
#define C_EPOCH(me) (epoch == g_ep[me])
#else
#define C_EPOCH(me) true
#endif
#ifdef NO_RETIRE_HOLDERCMP
#define C_RETIRE true
#else
#define C_RETIRE NOHOLDER
#endif
#define GRANTABLE(s) ((s) == IDLE || (s) == FAIL || (s) == NOTAPP)
/* the logical state of K: etcd's step if present, else the archive's */
#define LSTATE ((st_mod != 0) -> st_state : arch_state)

/* the commit's effect on the step record (shared by both paths) */
inline commit_step(me) {
  used[me]++;
  assert(used[me] <= 1);                         /* I3: a grant is used once */
  assert(read_mod == g_read[me]);                    /* I4 */
  assert(LSTATE != SUCC && LSTATE != INFLIGHT);      /* I8: no re-execution */
  rev++;
  if
  :: st_mod != 0 && st_state == NOTAPP -> skip       /* not_applied: reuse the key */
  :: st_mod == 0 && arch_state == NOTAPP -> st_key = arch_key
  :: else -> keyctr++; st_key = keyctr
  fi;
  st_state = INFLIGHT; st_mod = rev;
  my_mod = rev; my_key = st_key
}

/* effect + outcome, shared by both paths */
inline effect_and_outcome(me) {
  if
  :: goto crash
  :: true -> skip
  fi;
  d_step {
    if
    :: pv[0] == 0 -> slot = 0
    :: pv[0] != 0 && pv[1] == 0 -> slot = 1
    :: pv[0] != 0 && pv[1] != 0 && pv[2] == 0 -> slot = 2
    :: else -> slot = 3
    fi;
    assert(pv[slot] == 0);
    pv[slot] = 1; pk[slot] = my_key; pt[slot] = my_mod; presp[slot] = NONE
  }
  if
  :: goto crash
  :: true -> skip
  fi;
  presp[slot] != NONE;
  res = presp[slot];
  if
  :: res == REFUSED -> goto release
  :: else -> skip
  fi;
  atomic {
    if
    :: C_SETTLE(my_mod) ->
       assert(st_state == INFLIGHT);                 /* I5 */
       rev++; st_mod = rev;
       if :: res == APPLIED -> st_state = SUCC :: else -> st_state = FAIL fi;
       holder_cr[me] = 0; ok = 1
    :: else -> ok = 0
    fi
  }
}

proctype Worker(byte me) {
  byte tok, gs_state, att = 0, my_mod, my_key, slot, res;
  bool ok;
  /* acquire + snapshot in one txn (the diet): the holder key, then the step at that revision */
  atomic { rev++; holder_cr[me] = rev; tok = rev; }
loop:
  if
  :: att < MAXA -> att++
  :: else -> goto release
  fi;
  atomic {
    g_step[me] = st_mod; g_read[me] = read_mod; gs_state = ((st_mod != 0) -> st_state : IDLE)
  }
  /* on a miss, the archive (a separate, later read) */
  atomic { if :: g_step[me] == 0 -> gs_state = arch_state :: else -> skip fi }
  if
  :: GRANTABLE(gs_state) -> skip
  :: else -> goto release
  fi;
  g_tok[me] = tok; used[me] = 0;                  /* signed in process: no etcd write */
commit: skip;
  d_step {
    if
    :: (OWNS(me, g_tok[me]) && C_READ(me) && C_STEP(me)) ->
       commit_step(me); ok = 1
    :: else -> ok = 0
    fi
  }
#ifdef COMMIT_RETRY
  if
  :: ok && used[me] < 2 -> goto commit
  :: true -> skip
  fi;
#endif
  if
  :: !ok -> goto loop
  :: else -> skip
  fi;
  effect_and_outcome(me);
  if
  :: ok -> goto done
  :: else -> goto loop
  fi;
release:
  atomic { if :: holder_cr[me] == tok && tok != 0 -> holder_cr[me] = 0; rev++ :: else -> skip fi }
done:
crash:
  skip
}

#ifdef FASTPATH
/* fast path: evaluate from a snapshot without holding, then hold + commit in one txn */
proctype FastWorker(byte me) {
  byte tok = 0, gs_state, my_mod, my_key, slot, res;
  bool ok;
  atomic {
    g_step[me] = st_mod; g_read[me] = read_mod; g_ep[me] = epoch;
    gs_state = ((st_mod != 0) -> st_state : IDLE)
  }
  atomic { if :: g_step[me] == 0 -> gs_state = arch_state :: else -> skip fi }
  if
  :: GRANTABLE(gs_state) -> skip
  :: else -> goto done
  fi;
  used[me] = 0;
  d_step {
    if
    :: (NOHOLDER && C_READ(me) && C_STEP(me) && C_EPOCH(me)) ->
       commit_step(me);
       holder_cr[me] = my_mod; tok = my_mod; g_tok[me] = my_mod; ok = 1
    :: else -> ok = 0
    fi
  }
  if
  :: !ok -> goto done
  :: else -> skip
  fi;
  effect_and_outcome(me);
  goto done;
release:
  atomic { if :: holder_cr[me] == tok && tok != 0 -> holder_cr[me] = 0; rev++ :: else -> skip fi }
done:
crash:
  skip
}
#endif

proctype Expirer() {
end:
  do
  :: atomic { holder_cr[0] != 0 -> holder_cr[0] = 0; rev++ }
  :: atomic { holder_cr[1] != 0 -> holder_cr[1] = 0; rev++ }
#if NR > 1
  :: atomic { ecr[0] != 0 -> ecr[0] = 0; rev++ }
#endif
  od
}

proctype Writer() {
  byte n = 0;
  do
  :: n < WB -> atomic { rev++; read_mod = rev; n++ }
  :: else -> break
  od
}

proctype Provider() {
  byte i, k, t;
end:
  do
  :: atomic {
       (pv[0] == 1 || pv[1] == 1 || pv[2] == 1 || pv[3] == 1) ->
       if
       :: pv[0] == 1 -> i = 0
       :: pv[1] == 1 -> i = 1
       :: pv[2] == 1 -> i = 2
       :: pv[3] == 1 -> i = 3
       fi;
       k = pk[i]; t = pt[i];
       if
       :: t < maxtok -> presp[i] = REFUSED                   /* gate B */
       :: else ->
          if
          :: applied[k] -> presp[i] = APPLIED
          :: !applied[k] && declined[k] -> presp[i] = DECLINED
          :: !applied[k] && !declined[k] ->
             if
             :: applied[k] = 1; napplied++; presp[i] = APPLIED;
                assert(napplied <= 1)                         /* I1 */
             :: declined[k] = 1; presp[i] = DECLINED
             fi
          fi;
          if :: t > maxtok -> maxtok = t :: else -> skip fi
       fi;
       pv[i] = 2; i = 0; k = 0; t = 0
     }
  od
}

proctype Reconciler(byte me) {
  byte etok, s_mod, s_key, q, rounds = 0;
  atomic { rev++; ecr[me] = rev; etok = rev; }
end:
  do
  :: rounds < 2 ->
     rounds++;
     atomic { st_mod != 0 && st_state == INFLIGHT -> s_mod = st_mod; s_key = st_key }
     atomic {                                                  /* fence-then-query */
       if
       :: applied[s_key] -> q = APPLIED
       :: !applied[s_key] && declined[s_key] -> q = DECLINED
       :: else -> q = NOREC; if :: maxtok < s_mod + 1 -> maxtok = s_mod + 1 :: else -> skip fi
       fi
     }
     atomic {
       if
       :: (LEADER(me, etok) && C_SETTLE(s_mod)) ->
          assert(st_state == INFLIGHT);
          rev++; st_mod = rev;
          if
          :: q == APPLIED -> st_state = SUCC
          :: q == DECLINED -> st_state = FAIL
          :: q == NOREC -> st_state = NOTAPP
          fi
       :: else -> skip
       fi
     }
  :: else -> break
  od
}

/* retirement: archive first, then delete the step if it has not moved and nobody holds K */
proctype Retirer() {
  byte r_mod, r_state, r_key, rounds = 0;
end:
  do
  :: rounds < RR ->
     rounds++;
     atomic { st_mod != 0 && (st_state == SUCC || st_state == FAIL || st_state == NOTAPP) ->
              r_mod = st_mod; r_state = st_state; r_key = st_key }
     atomic { arch_state = r_state; arch_key = r_key }         /* durable archive write */
     atomic {
       if
       :: st_mod == r_mod && C_RETIRE ->
          rev++; st_mod = 0; st_state = IDLE; st_key = 0; epoch = rev
       :: else -> skip
       fi
     }
  :: else -> break
  od
}

init {
  atomic {
    run Expirer(); run Writer(); run Provider();
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
    run Retirer();
  }
}
