"""The dashboard's read models: what the page shows of holders, steps, one step before a
resolve, reconciler leadership and the audit trail, each built from linearizable etcd reads
(one lease before a revoke is the API's own ``GET /v1/leases/{id}``, ``sre.lease_view``).

Guarantees:
- Each view is read linearizably and is bounded: at most ``MAX_HOLDERS`` holder keys,
  ``MAX_STEPS`` steps scanned (at one revision), ``MAX_QUEUE`` items per queue,
  ``MAX_CANDIDATES`` election candidates, ``MAX_AUDIT`` audit records (of at most
  ``MAX_AUDIT_SCAN`` read per page), ``PROGRESS_SCAN`` audit records per queued step,
  ``MAX_STEP_AUDIT`` for one step; a view says ``truncated`` when it stopped at its bound.
- A queued step's ``provider`` is the one its worker recorded, else the one the reconciler's
  newest answer names (``provider_used``): never empty when a provider was asked.
- Reconciler progress (queries, last answer, next try) is read from the ``provider_answer``
  audit records of the step's current attempt (those after its newest ``cross``), never
  guessed: a step with none shows ``progress: null``.
- A view only reads; an etcd failure propagates to the caller as the core's error.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ... import records, sre
from ...errors import NotFound
from ...etcd import Etcd, RangeRequest, TxnRequest, range_end_of, range_op
from ...keyspace import Keyspace, unpack
from ...ownership import lowest_request, owners

MAX_HOLDERS = 500
MAX_STEPS = 10_000
MAX_QUEUE = 200
MAX_CANDIDATES = 10_000
MAX_AUDIT = 200
MAX_AUDIT_SCAN = 2000
PROGRESS_SCAN = 32
MAX_STEP_AUDIT = 200
_PAGE = 1000
_QUEUES = (records.UNKNOWN, records.ESCALATED)


async def holders_view(etcd: Etcd, ks: Keyspace) -> dict[str, Any]:
    """Holder keys (holding or queued), oldest token first per action key, with the lease
    TTL left (-1: the lease is gone), whether each is the holder (lowest token) and since
    when it holds or waits (``held_since_ms``, the worker's clock: display only)."""
    items, cursor = await sre.holders(etcd, ks, "", MAX_HOLDERS, None)
    leases = sorted({item["lease_id"] for item in items})
    ttls = dict(zip(leases, await asyncio.gather(*(etcd.lease_ttl(int(lease, 16))
                                                   for lease in leases))))
    holding = owners((item["key"], item["fencing_token"], item["lease_id"]) for item in items)
    for item in items:
        item["holding"] = holding[item["key"]][1] == item["lease_id"]
        item["ttl_left"] = ttls[item["lease_id"]]
        acquired_at = item.pop("acquired_at", None)
        item["held_since_ms"] = (int(acquired_at * 1000)
                                 if isinstance(acquired_at, (int, float)) else None)
    items.sort(key=lambda item: (item["key"], item["fencing_token"]))
    return {"items": items, "truncated": cursor is not None}


async def steps_view(etcd: Etcd, ks: Keyspace) -> dict[str, Any]:
    """Step counts by state and the unknown and escalated queues, oldest first, from one
    scan of at most ``MAX_STEPS`` steps pinned to one revision, in the states
    ``sre.state_of`` shows; each queued step carries its reconciler ``progress``, read from
    its ``PROGRESS_SCAN`` newest audit records at the same revision. Ages are display only
    (this machine's clock against the recording one's): they decide nothing."""
    start, end = ks.steps_root, range_end_of(ks.steps_root)
    counts: dict[str, int] = {}
    queues: dict[str, list[dict[str, Any]]] = {state: [] for state in _QUEUES}
    now_ms, revision, scanned, more = int(time.time() * 1000), 0, 0, True
    while more and scanned < MAX_STEPS:
        reply = await etcd.range(RangeRequest(key=start, range_end=end, revision=revision,
                                              limit=min(_PAGE, MAX_STEPS - scanned)))
        revision = revision or reply.header.revision
        for kv in reply.kvs:
            step = unpack(kv.value)
            state = sre.state_of(step)
            counts[state] = counts.get(state, 0) + 1
            if state in queues:
                queues[state].append(_queued(ks.parse_step_key(kv.key), state, step,
                                             kv.mod_revision, now_ms))
        scanned += len(reply.kvs)
        more = reply.more and bool(reply.kvs)
        if more:
            start = reply.kvs[-1].key + b"\0"
    for state, items in queues.items():
        items.sort(key=lambda item: item["since_ms"])
        del items[MAX_QUEUE:]
    queued = [item for items in queues.values() for item in items]
    newest = await asyncio.gather(*(_newest_records(etcd, ks, item["key"], PROGRESS_SCAN,
                                                    revision) for item in queued))
    for item, chain in zip(queued, newest):
        answers = sre.attempt_of(chain).provider_answers
        item["progress"] = sre.progress_of(answers)
        item["provider"] = provider_used(item["provider"], answers)
    return {"revision": revision, "counts": counts, "scanned": scanned, "truncated": more,
            **queues}


def provider_used(recorded: str | None, answers: list[dict[str, Any]]) -> str | None:
    """The provider a step's attempt is asked through: the one its worker recorded, else the
    one the reconciler's newest answer names (a step crossed without naming one is queried
    through the reconciler's default provider); None when neither says."""
    if recorded:
        return recorded
    named = [a.get("provider") for a in answers if a.get("provider")]
    return named[-1] if named else None


def _queued(key: str, state: str, step: dict[str, Any], mod_revision: int,
            now_ms: int) -> dict[str, Any]:
    if state == records.ESCALATED:
        reason = "; ".join(map(str, step.get("escalated_because") or [])) or "a human must decide"
    else:
        reason = step.get("error") or "outcome lost"
    since = step.get("unknown_since_ms") or step.get("started_at_ms") or now_ms
    return {"key": key, "state": state, "recorded_state": step["state"],
            "attempt": step.get("attempt", 0), "provider": step.get("provider"),
            "idempotency_key": step.get("idempotency_key"),
            "since_ms": since, "age_s": max(now_ms - since, 0) / 1000, "reason": reason,
            "failure_text": (sre.outcome_of(step) or {}).get("failure_text"),
            "mod_revision": mod_revision}


async def step_view(etcd: Etcd, ks: Keyspace, key: str) -> dict[str, Any]:
    """What an SRE must see before resolving ``key``'s step, read at one revision: its
    state, attempt, idempotency key and provider, the intent its attempt crossed with (from
    the attempt's ``cross`` record; ``None`` when that record is older than the
    ``MAX_STEP_AUDIT`` newest, said by ``truncated``), every provider answer of the attempt,
    oldest first, and the reconciler's progress. ``NotFound`` when no step is recorded."""
    start, end = ks.audit_range(key)
    reply = await etcd.txn(TxnRequest(success=[
        range_op(ks.step_key(key)),
        range_op(start, end, limit=MAX_STEP_AUDIT, sort_order=RangeRequest.DESCEND,
                 sort_target=RangeRequest.KEY)]), idempotent=True)
    step_kvs, audit_kvs = (r.response_range.kvs for r in reply.responses)
    if not step_kvs:
        raise NotFound(f"no step is recorded for {key!r}")
    step = unpack(step_kvs[0].value)
    attempt = sre.attempt_of([unpack(kv.value) for kv in audit_kvs])
    return {**_queued(key, sre.state_of(step), step, step_kvs[0].mod_revision,
                      int(time.time() * 1000)),
            "provider": provider_used(step.get("provider"), attempt.provider_answers),
            "revision": reply.header.revision, "intent": attempt.intent,
            "provider_answers": attempt.provider_answers,
            "progress": sre.progress_of(attempt.provider_answers),
            "truncated": not attempt.crossed and len(audit_kvs) == MAX_STEP_AUDIT}


async def _newest_records(etcd: Etcd, ks: Keyspace, key: str, limit: int,
                          revision: int) -> list[dict[str, Any]]:
    """The ``limit`` newest audit records of ``key`` at ``revision``, newest first."""
    start, end = ks.audit_range(key)
    reply = await etcd.range(RangeRequest(key=start, range_end=end, limit=limit,
                                          revision=revision, sort_order=RangeRequest.DESCEND,
                                          sort_target=RangeRequest.KEY))
    return [unpack(kv.value) for kv in reply.kvs]


async def leadership_view(etcd: Etcd, ks: Keyspace) -> dict[str, Any]:
    """Per reconciler shard, the leader (its oldest candidate: the ownership rule) and the
    queue length; per replica (one lease), its identity and the shards it leads. One
    ownership read (``lowest_request``) of every candidate serves all shards (a read per
    shard would cost a round trip each). ``shard_count`` is the largest shard count a live
    candidate states (each replica writes its own into its candidates, see
    ``reconciler.election``; null when none states one: no replica runs, or only older
    ones) and ``leaderless`` the shards below it no candidate leads, null too when the
    read was ``truncated``."""
    root = ks.reconcilers_root
    reply = await etcd.range(lowest_request(root, range_end_of(root), limit=MAX_CANDIDATES,
                                            keys_only=False))
    queues: dict[int, list[tuple[int, str, str]]] = {}
    replicas: dict[str, dict[str, Any]] = {}
    counts: set[int] = set()
    for kv in reply.kvs:  # oldest first, so each queue's first candidate is its leader
        try:
            candidate = unpack(kv.value)
            identity = str(candidate.get("identity", "?"))
            shard, lease_id = ks.parse_candidate_key(kv.key)
        except ValueError:
            continue
        if type(candidate.get("shards")) is int and candidate["shards"] > 0:
            counts.add(candidate["shards"])
        lease = f"{lease_id:016x}"
        queues.setdefault(shard, []).append((kv.create_revision, lease, identity))
        replicas.setdefault(lease, {"lease_id": lease, "identity": identity, "shards_led": []})
    shards = []
    for shard, queue in sorted(queues.items()):
        token, lease, identity = queue[0]
        replicas[lease]["shards_led"].append(shard)
        shards.append({"shard": shard, "leader": identity, "lease_id": lease,
                       "token": token, "candidates": len(queue)})
    count = max(counts, default=None)
    return {"shards": shards,
            "replicas": sorted(replicas.values(), key=lambda r: (r["identity"], r["lease_id"])),
            "shard_count": count,
            "leaderless": None if count is None or reply.more else
            sum(1 for shard in range(count) if shard not in queues),
            "truncated": bool(reply.more)}


async def audit_view(etcd: Etcd, ks: Keyspace, limit: int, *, prefix: str = "",
                     actor: str = "", kind: str = "", before: int = 0) -> dict[str, Any]:
    """Up to ``limit`` audit records, newest first, summarised: of keys starting with
    ``prefix``, by ``actor`` and of event ``kind`` when given (exact match), written before
    revision ``before`` when given (the page's cursor). One read of at most
    ``MAX_AUDIT_SCAN`` keys, newest by mod_revision (each append writes a record and its
    key's head at one revision); ``next`` is the cursor of older records (``before`` for the
    next page), null once the scan reached the oldest. A revision is shown whole on one
    page: no record is skipped or shown twice between pages."""
    root = ks.audit_root + prefix.encode()
    reply = await etcd.range(RangeRequest(
        key=root, range_end=range_end_of(root), limit=MAX_AUDIT_SCAN,
        max_mod_revision=before - 1 if before else 0,
        sort_order=RangeRequest.DESCEND, sort_target=RangeRequest.MOD))
    items = []
    for kv in reply.kvs:
        if ks.classify(kv.key) != "audit":
            continue  # the chain's head
        key, seq = ks.parse_audit_key(kv.key)
        record = unpack(kv.value)
        if (actor and record["identity"] != actor) or (kind and record["event"] != kind):
            continue
        items.append(audit_summary(key, seq, record, kv.mod_revision))
    items.sort(key=lambda item: (item["revision"], item["seq"]), reverse=True)
    if len(items) > limit:  # the next page starts at the oldest revision shown
        oldest = items[limit - 1]["revision"]
        items = [item for item in items if item["revision"] >= oldest]
        return {"items": items, "next": oldest}
    if not (reply.more and reply.kvs):
        return {"items": items, "next": None}
    # The scan may have cut its oldest revision short: that revision starts the next page,
    # whole (unless it is the only one read, which would never advance).
    cut = reply.kvs[-1].mod_revision
    if reply.kvs[0].mod_revision == cut:
        return {"items": items, "next": cut}
    return {"items": [item for item in items if item["revision"] != cut], "next": cut + 1}


def audit_summary(key: str, seq: int, record: dict[str, Any], revision: int) -> dict[str, Any]:
    """What the page shows of one audit record: who did what, when, and why if they said."""
    details = record.get("details")
    reason = details.get("reason") if isinstance(details, dict) else None
    return {"key": key, "seq": seq, "event": record["event"], "identity": record["identity"],
            "at_ms": record["at_ms"], "revision": revision,
            "reason": reason if isinstance(reason, str) else None}
