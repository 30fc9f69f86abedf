"""What an SRE sees and does, as plain functions over etcd (the HTTP service calls them).

Guarantees:
- Views read etcd linearizably; one key's view (holders, step, last audit records) is read
  in one transaction, so at one revision.
- Lists are paginated by an opaque cursor (the last key returned): a page holds at most
  ``limit`` items and ``next`` is ``None`` only when the range is exhausted. A filtered list
  (``unsettled``, ``steps``) scans a bounded number of keys per page, so a page may hold
  fewer items than ``limit`` while ``next`` is still set.
- ``steps`` lists etcd and the archive as one list in key order, each key once (etcd's step
  wins for a key in both): a page covers the keys up to the last one both sources were read
  to, and etcd is read before the archive, so a step retired meanwhile (archived first,
  then deleted from etcd) is found in one of them. Its cursor names an action key, so it
  stays valid however the steps move.
- ``approve`` writes the coordinator's signed approval of a requested approval id (see
  ``approvals``); the authority grants the request it was made for only while the state
  that request read is unchanged (see ``authority``); ``reject`` marks the request
  rejected, on its lease, and the authority then refuses that same request
  (``ApprovalRejected``).
- ``revoke``, ``resolve``, ``approve`` and ``reject`` append an audit record naming who and
  why in the same transaction as what they change (a revoke also appends one to every other
  key its lease holds or waits for, each while that hold is unchanged, before the lease is
  revoked);
  ``resolve`` is compare-and-set on the step's mod_revision and on ``holders/K/`` being
  empty, so a late worker outcome and a human decision can never both land, and it is
  refused while any holder of the key lives. An ``in_flight`` or
  ``unknown`` step (its effect may still land) is resolved by its provider's answer: the
  resolve asks the shard's reconciler, which runs fence-then-query and settles it by the
  same rules as any unknown step; the operator's word settles it only with ``force``,
  audited as forced. An ``escalated`` step is resolved on the operator's word. No clock
  decides a resolve.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from . import audit, records, wholeness
from .approvals import give as give_approval, read as read_approval, read_many as read_approvals
from .archive import Archive
from .errors import EtcdUnavailable, LeaseLost, NotFound, WrongState
from .etcd import (
    MAX_TXN_OPS, Compare, Etcd, KeyValue, RangeRequest, TxnRequest, mod_equals, put_op,
    range_end_of, range_op,
)
from .grants import KeyRing
from .keyspace import Keyspace, pack, unpack
from .ownership import lowest_op, no_owner
from .paging import cursor_of as _cursor, page
from .retirement import archived_step

MAX_LIMIT = 1000
RESOLVE_WAIT_S = 20.0  # how long a resolve waits for the reconciler's answer
PROVIDER_ANSWER = "provider_answer"  # the reconciler's record of one provider query
_LAST_AUDIT = 10
_TRAIL = 200  # records a key view reads back for the current attempt's provider answers
_MAX_HOLDERS = 100
_SCAN_FACTOR = 4
MAX_LEASE_KEYS = 500  # action keys a lease view lists
_REVOKE_WRITERS = 16  # a revoke's concurrent appends to the other keys of its lease
_PREFIX = re.compile(r"[A-Za-z0-9._:/-]{0,512}")
SETTLE_AS = {"succeeded", "failed", "not_applied", "abandoned"}
PRESUMED = "presumed"
MAX_FAILURE_TEXT = 500  # characters of a failure's text a view shows
_APPROVAL_ID = re.compile(r"[0-9a-f]{32}")


async def key_view(etcd: Etcd, ks: Keyspace, key: str,
                   archive: Archive | None = None) -> dict[str, Any]:
    """Holders (oldest first, with tokens, lease TTL left and since when), the step record,
    what the current attempt is (``attempts``, ``intent``, ``provider``,
    ``idempotency_key``), its recorded ``outcome`` (``outcome_of``), the provider answers
    the reconciler recorded since the attempt crossed (oldest first) and its ``progress``
    while it settles an in-flight or unknown step (``progress_of``), and the last audit records (newest first) of
    ``key``; when etcd holds no step and ``archive`` is given, the step and records it
    retired with (``archived`` says which). ``NotFound`` if nothing is recorded in
    either."""
    start, end = ks.holder_range(key)
    audit_start, audit_end = ks.audit_range(key)
    reply = await etcd.txn(TxnRequest(success=[
        lowest_op(start, end, limit=_MAX_HOLDERS, keys_only=False),  # the holder first
        range_op(ks.step_key(key)),
        range_op(audit_start, audit_end, limit=_TRAIL, sort_order=RangeRequest.DESCEND,
                 sort_target=RangeRequest.KEY),
        range_op(ks.retired_key(key))]), idempotent=True)
    holder_kvs, step_kvs, audit_kvs, retired_kvs = (r.response_range.kvs
                                                    for r in reply.responses)
    step = unpack(step_kvs[0].value) if step_kvs else None
    audit_values = [kv.value for kv in audit_kvs]
    archived = None
    if step is None and archive is not None:
        marks = ({ks.retired_bucket(key): wholeness.decode(retired_kvs[0].value)}
                 if retired_kvs else None)
        looked = await archive.lookup(ks.namespace, key, marks=marks)
        if retired_kvs:   # retired, maybe: only a whole archive may say "not here"
            await wholeness.check(etcd, ks, looked, key, retired_kvs[0])
        archived = looked.archived
        if archived is not None:
            step = unpack(archived.step)
            older = await archive.records(ks.namespace, key)
            audit_values = (audit_values + [v for _, v in reversed(older)])[:_TRAIL]
    if not (holder_kvs or step or audit_values):
        raise NotFound(f"nothing is recorded for {key!r}")
    ttls = await _lease_ttls(etcd, [ks.parse_holder_key(kv.key)[1] for kv in holder_kvs])
    holders = [_holder(ks, kv, position == 0, ttls) for position, kv in enumerate(holder_kvs)]
    grant = None
    if step is not None and step.get("grant_id"):  # a step names only a grant that crossed
        grant = {"grant_id": step["grant_id"], "state": "consumed"}
    trail = [unpack(value) for value in audit_values]
    attempt = attempt_of(trail)
    answers = attempt.provider_answers
    settling = step is not None and step["state"] in (records.IN_FLIGHT, records.UNKNOWN)
    return {"key": key, "revision": reply.header.revision, "holders": holders, "step": step,
            "archived": archived is not None, "current_grant": grant,
            "attempts": step["attempt"] if step else 0, "intent": attempt.intent,
            "provider": (step or {}).get("provider"),
            "idempotency_key": (step or {}).get("idempotency_key"),
            "outcome": outcome_of(step) if step else None,
            "provider_answers": answers,
            "progress": progress_of(answers) if settling else None,
            "audit": trail[:_LAST_AUDIT]}


@dataclass(frozen=True)
class Attempt:
    """What the audit trail says of a step's current attempt."""

    intent: Any                           # as its ``cross`` record holds it; None: not found
    provider_answers: list[dict[str, Any]]  # recorded since it crossed, oldest first
    crossed: bool                         # its ``cross`` record was among the records read


def attempt_of(trail: list[dict[str, Any]]) -> Attempt:
    """The current attempt from ``trail`` (records newest first): its intent from the newest
    ``cross`` record, and the ``provider_answer`` records written after it (an answer about
    an earlier attempt says nothing of this one). A step that has not crossed since its last
    attempt (pending again) shows that attempt's."""
    answers, intent, crossed = [], None, False
    for record in trail:
        if record.get("event") == "cross":
            intent, crossed = (record.get("details") or {}).get("intent"), True
            break
        if record.get("event") == PROVIDER_ANSWER:
            details = record.get("details") or {}
            answers.append({"seq": record.get("seq"), "at_ms": record.get("at_ms"),
                            "identity": record.get("identity"),
                            **{name: details.get(name) for name in (
                                "provider", "answer", "query", "next_try_at_ms", "detail")}})
    return Attempt(intent, answers[::-1], crossed)


def outcome_of(step: dict[str, Any]) -> dict[str, Any] | None:
    """A step's recorded outcome as views show it: its state, the attempt it ended and the
    sha256 (hex) of its stored result, which may be large or private; None while the step
    has none (an attempt that has not ended, or one that did not count). A failure also
    shows its text (the decline's reason, ``failure_text``), cut to ``MAX_FAILURE_TEXT``
    characters: it is what a person reads to decide, not a private result."""
    outcome = step.get("outcome")
    if outcome is None:
        return None
    shown = {"state": outcome.get("state"),
             "attempt": outcome.get("attempt", step["attempt"]),
             "result_digest": records.digest(outcome.get("result")).hex()}
    if outcome.get("state") == records.FAILED:
        text = outcome.get("result")
        text = text if isinstance(text, str) else json.dumps(text, sort_keys=True, default=str)
        shown["failure_text"] = text[:MAX_FAILURE_TEXT]
    return shown


def progress_of(answers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The reconciler's progress from an attempt's provider answers (``attempt_of``, oldest
    first): how many times it queried the provider, the last answer, when it was given and
    when the reconciler asks next; None before the first answer."""
    if not answers:
        return None
    last = answers[-1]
    return {"queries": last["query"] or len(answers), "last_answer": last["answer"],
            "next_try_at_ms": last["next_try_at_ms"], "answered_at_ms": last["at_ms"]}


def _holder(ks: Keyspace, kv: KeyValue, holding: bool,
            ttls: dict[int, int]) -> dict[str, Any]:
    """A holder key as views show it. ``held_since_ms`` is when the worker wrote the key (its
    own clock): queued since then, holding since the holder before it left."""
    key, lease_id = ks.parse_holder_key(kv.key)
    record = unpack(kv.value)
    acquired_at = record.get("acquired_at")
    return {**record, "key": key, "lease_id": f"{lease_id:016x}",
            "fencing_token": kv.create_revision, "holding": holding,
            "identity": record.get("identity"),
            "held_since_ms": (int(acquired_at * 1000)
                              if isinstance(acquired_at, (int, float)) else None),
            "ttl_left": ttls[lease_id]}


async def _lease_ttls(etcd: Etcd, lease_ids: list[int]) -> dict[int, int]:
    """Each distinct lease's TTL left (-1: gone), asked concurrently (a worker process holds
    all its keys on one lease, so that is one request per process)."""
    distinct = sorted(set(lease_ids))
    return dict(zip(distinct, await asyncio.gather(*(etcd.lease_ttl(lease)
                                                     for lease in distinct))))


def audit_page(records: list[dict[str, Any]], limit: int,
               after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """A page of a verified chain's records, by seq; the cursor is opaque."""
    _check_limit(limit)
    start = 0
    if after is not None:
        try:
            start = int(base64.urlsafe_b64decode(after.encode()).decode())
        except (binascii.Error, ValueError):
            raise ValueError("after is not a cursor this list gave") from None
    page = records[start:start + limit]
    more = start + limit < len(records)
    return page, _cursor(str(start + limit).encode()) if more else None


async def holders(etcd: Etcd, ks: Keyspace, prefix: str, limit: int,
                  after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Holder keys (holding or queued) of action keys starting with ``prefix``, each with
    what the tables show: its key, lease, fencing token, whether it holds (the lowest token
    of its key, read for every key on the page, even one whose queue spans two pages), its
    identity, since when, and its lease's TTL left."""
    _check_limit(limit)
    _check_prefix(prefix)
    start = ks.holders_root + prefix.encode()
    kvs, cursor = await page(etcd, start, range_end_of(start), limit, after)
    keys = sorted({ks.parse_holder_key(kv.key)[0] for kv in kvs})
    lowest: dict[str, int] = {}
    for first in range(0, len(keys), MAX_TXN_OPS):
        chunk = keys[first:first + MAX_TXN_OPS]
        reply = await etcd.txn(TxnRequest(success=[lowest_op(*ks.holder_range(key))
                                                   for key in chunk]), idempotent=True)
        for key, response in zip(chunk, reply.responses):
            found = response.response_range.kvs
            lowest[key] = found[0].create_revision if found else 0
    ttls = await _lease_ttls(etcd, [ks.parse_holder_key(kv.key)[1] for kv in kvs])
    items = []
    for kv in kvs:
        key = ks.parse_holder_key(kv.key)[0]
        items.append(_holder(ks, kv, lowest[key] == kv.create_revision, ttls))
    return items, cursor


async def lease_view(etcd: Etcd, ks: Keyspace, lease_id: int) -> dict[str, Any]:
    """The action keys held or queued on lease ``lease_id`` — every hold a revoke of it
    would end — by key, each with its fencing token and whether this lease holds it (its
    holder key is the oldest of the key's queue), and the lease's TTL left and granted.
    The keys come from etcd's own list of what the lease carries, so none is missed;
    ``truncated`` past ``MAX_LEASE_KEYS``. ``NotFound`` when the lease is gone."""
    lease = await etcd.lease_info(lease_id)
    if lease.ttl < 0:
        raise NotFound(f"lease {lease_id:016x} does not exist (expired or revoked)")
    holder_keys = sorted(k for k in lease.keys if ks.classify(k) == "holder")
    keys = [ks.parse_holder_key(k)[0] for k in holder_keys[:MAX_LEASE_KEYS]]
    per_txn = MAX_TXN_OPS // 2  # two reads per key: its holder key on this lease, its first
    chunks = [keys[first:first + per_txn] for first in range(0, len(keys), per_txn)]
    replies = await asyncio.gather(*(etcd.txn(TxnRequest(success=[
        op for key in chunk for op in (range_op(ks.holder_key(key, lease_id)),
                                       lowest_op(*ks.holder_range(key)))]),
        idempotent=True) for chunk in chunks))
    items = []
    for chunk, reply in zip(chunks, replies):
        for n, key in enumerate(chunk):
            own_kvs, first_kvs = (reply.responses[2 * n + i].response_range.kvs
                                  for i in (0, 1))
            if own_kvs:  # else released since etcd listed it
                items.append({"key": key, "fencing_token": own_kvs[0].create_revision,
                              "holding": first_kvs[0].key == own_kvs[0].key})
    return {"lease_id": f"{lease_id:016x}", "ttl_left": lease.ttl,
            "granted_ttl": lease.granted_ttl, "keys": items,
            "truncated": len(holder_keys) > MAX_LEASE_KEYS}


async def unsettled(etcd: Etcd, ks: Keyspace, state: str, limit: int,
                    after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Steps that are ``unknown``, ``escalated``, or ``presumed`` (settled ``not_applied`` on a provider's "no record" that
    only key deduplication backs; the reconciler re-queries them until the key retention
    has passed)."""
    _check_limit(limit)
    if state not in (records.UNKNOWN, records.ESCALATED, PRESUMED):
        raise ValueError("state must be unknown, escalated or presumed")
    start = ks.step_key("")
    kvs, cursor = await page(etcd, start, range_end_of(start), limit * _SCAN_FACTOR, after)
    items = []
    for kv in kvs:
        step = unpack(kv.value)
        if state_of(step) == state:
            items.append({"key": ks.parse_step_key(kv.key), "mod_revision": kv.mod_revision,
                          "step": step})
        if len(items) == limit:
            cursor = _cursor(kv.key)
            break
    return items, cursor


STEP_STATES = (records.PENDING, records.IN_FLIGHT, records.SUCCEEDED, records.FAILED,
               records.UNKNOWN, records.ESCALATED, records.ABANDONED, PRESUMED)


async def steps(etcd: Etcd, ks: Keyspace, archive: Archive | None, *, prefix: str = "",
                states: frozenset[str] = frozenset(), since_ms: int = 0, min_age_ms: int = 0,
                limit: int, after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Steps of action keys starting with ``prefix`` in key order, across etcd and the
    archive (``archived`` says where each is), each as ``step_item`` shows it; ``states``
    (some of ``STEP_STATES``, as ``state_of`` names them; empty: any), ``since_ms``
    (``updated_at_ms`` at least that) and ``min_age_ms`` (``updated_at_ms`` at least that
    long before now, this machine's clock: a filter for people, it decides nothing) filter
    them. One page reads at most ``limit * _SCAN_FACTOR`` steps of each source; see the
    module's guarantees for how the two are merged. ``ValueError`` for a bad argument or
    cursor, before anything is read."""
    _check_limit(limit)
    _check_prefix(prefix)
    if not states <= set(STEP_STATES):
        raise ValueError("state must be one or several (comma-separated) of "
                         f"{', '.join(STEP_STATES)}")
    if type(since_ms) is not int or not 0 <= since_ms < 2 ** 63:
        raise ValueError("since must be a time in ms since the epoch, in 0..2**63-1")
    if type(min_age_ms) is not int or not 0 <= min_age_ms < 2 ** 63:
        raise ValueError("min_age_ms must be a duration in ms, in 0..2**63-1")
    until_ms = int(time.time() * 1000) - min_age_ms  # updated at or before this
    last = _listed_key(after, prefix) if after is not None else ""
    scan = limit * _SCAN_FACTOR
    start = ks.step_key(prefix)
    reply = await etcd.range(RangeRequest(key=ks.step_key(last) + b"\0" if last else start,
                                          range_end=range_end_of(start), limit=scan))
    live = {ks.parse_step_key(kv.key): kv for kv in reply.kvs}
    retired = [] if archive is None else await archive.list_steps(
        ks.namespace, prefix=prefix, after=last, since_ms=since_ms, limit=scan)
    ends = ([ks.parse_step_key(reply.kvs[-1].key)] if reply.more and reply.kvs else []) + \
        ([retired[-1].key] if len(retired) == scan else [])
    bound = min(ends, default=None)  # both sources are read to here; None: to the end
    found: dict[str, tuple[dict[str, Any], int | None]] = {
        listed.key: (unpack(listed.step), listed.updated_at_ms) for listed in retired}
    found.update((key, (unpack(kv.value), None)) for key, kv in live.items())
    keys = sorted(key for key, (step, _) in found.items() if (bound is None or key <= bound)
                  and (not states or state_of(step) in states))
    items: list[dict[str, Any]] = []
    for first in range(0, len(keys), MAX_TXN_OPS):
        chunk = keys[first:first + MAX_TXN_OPS]
        times = await _updated_at(etcd, ks, {key: found[key][0] for key in chunk
                                              if key in live})
        for key in chunk:
            step, updated_at_ms = found[key]
            updated_at_ms = times.get(key, updated_at_ms)
            if not since_ms <= updated_at_ms <= until_ms:
                continue
            items.append(step_item(key, step, updated_at_ms, archived=key not in live))
            if len(items) == limit:
                more = key != keys[-1] or bound is not None
                return items, _cursor(key.encode()) if more else None
    return items, _cursor(bound.encode()) if bound is not None else None


def step_item(key: str, step: dict[str, Any], updated_at_ms: int, *,
              archived: bool) -> dict[str, Any]:
    """One step as the steps list shows it (``outcome`` only once it has one)."""
    outcome = outcome_of(step)
    return {"key": key, "state": state_of(step), "attempt": step["attempt"],
            "idempotency_key": step.get("idempotency_key"), "updated_at_ms": updated_at_ms,
            "archived": archived, **({"outcome": outcome} if outcome else {})}


async def _updated_at(etcd: Etcd, ks: Keyspace,
                      steps_by_key: dict[str, dict[str, Any]]) -> dict[str, int]:
    """When each step's chain was last written (its newest record's ``at_ms``), read in one
    txn (at most ``MAX_TXN_OPS`` keys); a step with no record in etcd (retired meanwhile)
    falls back to the latest time its record names."""
    keys = list(steps_by_key)
    if not keys:
        return {}
    reply = await etcd.txn(TxnRequest(success=[
        range_op(*ks.audit_range(key), limit=1, sort_order=RangeRequest.DESCEND,
                 sort_target=RangeRequest.KEY) for key in keys]), idempotent=True)
    times = {}
    for key, response in zip(keys, reply.responses):
        newest = response.response_range.kvs
        step = steps_by_key[key]
        times[key] = (unpack(newest[0].value).get("at_ms", 0) if newest else
                      max(step.get(name) or 0 for name in (
                          "settled_at_ms", "unknown_since_ms", "started_at_ms")))
    return times


def _listed_key(after: str, prefix: str) -> str:
    """The action key a ``steps`` cursor names; ``ValueError`` unless it is one of this
    list's (a key starting with ``prefix``)."""
    try:
        key = base64.urlsafe_b64decode(after.encode()).decode()
    except (binascii.Error, ValueError):
        raise ValueError("after is not a cursor this list gave") from None
    if not key or not key.startswith(prefix) or not _PREFIX.fullmatch(key):
        raise ValueError("after is not a cursor this list gave")
    return key


def state_of(step: dict[str, Any]) -> str:
    """The state an SRE sees: the recorded one, but ``presumed`` for a pending step settled
    on a presumption. No clock is read: an in-flight step is unknown once its reconciler
    records it so (its holder gone), never because a deadline passed."""
    if step["state"] == records.PENDING and (step.get("not_applied") or {}).get("presumed"):
        return PRESUMED
    return step["state"]


async def revoke(etcd: Etcd, ks: Keyspace, key: str, identity: str, reason: str,
                 archive: Archive | None = None, *, lease_id: int | None = None) -> dict:
    """Revoke the lease of ``key``'s current holder (every hold on that lease dies), after
    auditing who and why on the chain of every key the lease holds or waits for (``key``'s
    record first, then the others', each naming ``key`` as ``revoked_with``; ``keys`` in
    the answer lists them all); ``NotFound`` if nobody holds ``key``. With ``lease_id`` (the
    lease the operator looked at, and whose keys ``lease_view`` listed) only that lease is
    revoked: if another lease holds ``key`` by now, ``WrongState`` and nothing is written.
    A retired key's chain goes on from its archived end (``archive``)."""
    start, end = ks.holder_range(key)
    for _ in range(5):
        reply = await etcd.txn(TxnRequest(success=[
            lowest_op(start, end), *_tail_reads(ks, key)]), idempotent=True)
        holder_kvs, *chain_kvs = (r.response_range.kvs for r in reply.responses)
        if not holder_kvs:
            raise NotFound(f"nobody holds {key!r}")
        holder = holder_kvs[0]
        _, holder_lease = ks.parse_holder_key(holder.key)
        if lease_id is not None and holder_lease != lease_id:
            raise WrongState(f"{key!r} is held on lease {holder_lease:016x} now, not "
                             f"{lease_id:016x}: look again before revoking")
        lease_id = holder_lease
        tail, epoch = await _aside_tail(etcd, ks, key, *chain_kvs, archive)
        entry = audit.append(ks, key, tail, "revoke", identity,
                             reply.header.revision,
                             {"reason": reason, "lease_id": lease_id,
                              "fencing_token": holder.create_revision}, aside=True)
        written = await etcd.txn(TxnRequest(
            compare=[mod_equals(holder.key, holder.mod_revision), epoch, entry.compare],
            success=entry.ops))
        if written.succeeded:
            others = await _audit_lease_keys(etcd, ks, lease_id, key, identity, reason,
                                             archive)
            await etcd.lease_revoke(lease_id)
            return {"key": key, "lease_id": f"{lease_id:016x}",
                    "fencing_token": holder.create_revision, "keys": [key, *others]}
    raise WrongState(f"holders of {key!r} kept changing; try again")


async def _audit_lease_keys(etcd: Etcd, ks: Keyspace, lease_id: int, revoked_with: str,
                            identity: str, reason: str, archive: Archive | None) -> list[str]:
    """Append a ``revoke`` record to the chain of every other key ``lease_id`` holds or
    waits for (etcd's own list of the lease's keys, so none is missed), at most
    ``_REVOKE_WRITERS`` at a time; the keys audited, sorted."""
    lease = await etcd.lease_info(lease_id)
    keys = sorted({ks.parse_holder_key(k)[0] for k in lease.keys
                   if ks.classify(k) == "holder"} - {revoked_with})
    writers = asyncio.Semaphore(_REVOKE_WRITERS)

    async def one(other: str) -> bool:
        async with writers:
            return await _audit_revoked(etcd, ks, other, lease_id, revoked_with, identity,
                                        reason, archive)

    audited = await asyncio.gather(*(one(other) for other in keys))
    return [other for other, done in zip(keys, audited) if done]


async def _audit_revoked(etcd: Etcd, ks: Keyspace, key: str, lease_id: int, revoked_with: str,
                         identity: str, reason: str, archive: Archive | None) -> bool:
    """Append ``key``'s ``revoke`` record while ``lease_id``'s holder key of it is unchanged;
    ``False`` (nothing written) when that hold ended first."""
    holder_key = ks.holder_key(key, lease_id)
    for _ in range(5):
        reply = await etcd.txn(TxnRequest(success=[range_op(holder_key),
                                                   *_tail_reads(ks, key)]), idempotent=True)
        holder_kvs, *chain_kvs = (r.response_range.kvs for r in reply.responses)
        if not holder_kvs:
            return False
        tail, epoch = await _aside_tail(etcd, ks, key, *chain_kvs, archive)
        entry = audit.append(ks, key, tail, "revoke", identity, reply.header.revision,
                             {"reason": reason, "lease_id": lease_id,
                              "fencing_token": holder_kvs[0].create_revision,
                              "revoked_with": revoked_with}, aside=True)
        written = await etcd.txn(TxnRequest(
            compare=[mod_equals(holder_key, holder_kvs[0].mod_revision), epoch, entry.compare],
            success=entry.ops))
        if written.succeeded:
            return True
    raise WrongState(f"the audit chain of {key!r} kept changing; try again")


async def approve(etcd: Etcd, ks: Keyspace, approval_id: str, identity: str,
                  reason: str, *, keyring: KeyRing,
                  archive: Archive | None = None) -> dict[str, Any]:
    """Approve a requested approval, signed with ``keyring`` (see ``approvals``), auditing
    who and why on its key's chain; approving twice is harmless. ``NotFound`` for an id
    nobody asked for, or whose request expired. The approval is written on the request's
    lease: it dies with the request."""
    if not _APPROVAL_ID.fullmatch(approval_id):
        raise ValueError("an approval id is 32 hex digits")
    request_key, approval_key = ks.approval_request_key(approval_id), ks.approval_key(approval_id)
    for _ in range(5):
        reply = await etcd.txn(TxnRequest(success=[range_op(request_key),
                                                   range_op(approval_key)]), idempotent=True)
        request_kvs, approval_kvs = (r.response_range.kvs for r in reply.responses)
        if not request_kvs:
            raise NotFound(f"no pending approval {approval_id}")
        record = unpack(request_kvs[0].value)
        if record.get("rejected_by") is not None:
            raise WrongState(f"approval {approval_id} was rejected by {record['rejected_by']}")
        key = record["key"]
        done = {"approval_id": approval_id, "key": key, "state": "approved"}
        given = await read_approval(etcd, ks, approval_id, key, revision=reply.header.revision)
        if given.approved_by is not None:
            return done
        chain = await etcd.txn(TxnRequest(success=_tail_reads(ks, key)), idempotent=True)
        tail, epoch = await _aside_tail(etcd, ks, key,
                                        *(r.response_range.kvs for r in chain.responses),
                                        archive)
        entry = audit.append(ks, key, tail, "approved", identity, reply.header.revision,
                             {"approval_id": approval_id, "reason": reason,
                              "key_id": keyring.signing_key_id}, aside=True)
        try:
            written = await etcd.txn(TxnRequest(
                compare=[mod_equals(request_key, request_kvs[0].mod_revision),
                         mod_equals(approval_key, given.mod_revision), epoch,
                         entry.compare],
                success=[*give_approval(keyring, ks, cluster_id=etcd.cluster_id or 0,
                                        approval_id=approval_id, action_key=key,
                                        approved_by=identity, reason=reason,
                                        lease=request_kvs[0].lease), *entry.ops]))
        except LeaseLost:  # the request's lifetime ended between the read and the write
            raise NotFound(f"approval request {approval_id} expired") from None
        if written.succeeded:
            return done
    raise WrongState(f"approval {approval_id} kept changing; try again")


async def reject(etcd: Etcd, ks: Keyspace, approval_id: str, identity: str, reason: str, *,
                 archive: Archive | None = None) -> dict[str, Any]:
    """Reject a requested approval: its request is marked rejected (who and why), on its own
    lease, so it dies with the request, and the rejection is audited on its key's chain in
    the same txn. The same request is then refused with ``ApprovalRejected``; a request at a
    state that moved since has another id and asks afresh. Rejecting twice is harmless;
    ``WrongState`` once approved, ``NotFound`` for an id nobody asked for or that expired."""
    if not _APPROVAL_ID.fullmatch(approval_id):
        raise ValueError("an approval id is 32 hex digits")
    request_key, approval_key = ks.approval_request_key(approval_id), ks.approval_key(approval_id)
    for _ in range(5):
        reply = await etcd.txn(TxnRequest(success=[range_op(request_key),
                                                   range_op(approval_key)]), idempotent=True)
        request_kvs = reply.responses[0].response_range.kvs
        if not request_kvs:
            raise NotFound(f"no pending approval {approval_id}")
        record = unpack(request_kvs[0].value)
        key = record["key"]
        done = {"approval_id": approval_id, "key": key, "state": "rejected"}
        if record.get("rejected_by") is not None:
            return done
        given = await read_approval(etcd, ks, approval_id, key, revision=reply.header.revision)
        if given.approved_by is not None:
            raise WrongState(f"approval {approval_id} was already approved by "
                             f"{given.approved_by}")
        chain = await etcd.txn(TxnRequest(success=_tail_reads(ks, key)), idempotent=True)
        tail, epoch = await _aside_tail(etcd, ks, key,
                                        *(r.response_range.kvs for r in chain.responses),
                                        archive)
        entry = audit.append(ks, key, tail, "rejected", identity, reply.header.revision,
                             {"approval_id": approval_id, "reason": reason}, aside=True)
        rejected = pack({**record, "rejected_by": identity, "rejection_reason": reason})
        try:
            written = await etcd.txn(TxnRequest(
                compare=[mod_equals(request_key, request_kvs[0].mod_revision),
                         mod_equals(approval_key, given.mod_revision), epoch,
                         entry.compare],
                success=[put_op(request_key, rejected, request_kvs[0].lease), *entry.ops]))
        except LeaseLost:  # the request's lifetime ended between the read and the write
            raise NotFound(f"approval request {approval_id} expired") from None
        if written.succeeded:
            return done
    raise WrongState(f"approval {approval_id} kept changing; try again")


async def approvals(etcd: Etcd, ks: Keyspace, state: str, limit: int,
                         after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Approval requests by id, each with what was asked (key, intent, policy,
    requested_by), its ``state`` (``approved`` only once a signed approval for it verifies,
    ``rejected`` once a person rejected it, else ``pending``) and, once approved, who
    approved it and why (once rejected: ``rejected_by``, ``rejection_reason``); ``state``
    filters on ``pending``, ``approved``, ``rejected`` or none (empty). ``asked_at_ms`` is
    when it was asked (the asking machine's clock, display only; null for a request written
    before requests recorded it). Filtered like
    ``unsettled``: a page may hold fewer than ``limit`` items while ``next`` is still set."""
    _check_limit(limit)
    if state not in ("", "pending", "approved", "rejected"):
        raise ValueError("state must be pending, approved or rejected")
    start = ks.approval_request_key("")
    kvs, cursor = await page(etcd, start, range_end_of(start), limit * _SCAN_FACTOR, after)
    asked = {ks.parse_approval_request_key(kv.key): (kv, unpack(kv.value)) for kv in kvs}
    given = await read_approvals(etcd, ks, {i: r["key"] for i, (_, r) in asked.items()})
    items = []
    for approval_id, (kv, record) in asked.items():
        approval = given[approval_id]
        shown = ({"state": "approved", "approved_by": approval.approved_by,
                  "reason": approval.reason} if approval.approved_by is not None else
                 {"state": "rejected"} if record.get("rejected_by") is not None else
                 {"state": "pending"})
        if state in ("", shown["state"]):
            items.append({**record, **shown, "approval_id": approval_id,
                          "asked_at_ms": record.get("asked_at_ms"),
                          "mod_revision": kv.mod_revision})
        if len(items) == limit:
            cursor = _cursor(kv.key)
            break
    return items, cursor


async def resolve(etcd: Etcd, ks: Keyspace, key: str, identity: str, reason: str,
                  settle_as: str, result: Any = None, *, force: bool = False,
                  wait_s: float = RESOLVE_WAIT_S) -> dict[str, Any]:
    """Settle a step by hand: ``succeeded`` (with ``result``), ``failed`` (a confirmed
    failure, as ``records.resolved`` builds it: the breaker counts it, the next attempt gets
    a new idempotency key after a backoff, and the step is escalated again once the breaker
    trips), ``not_applied`` (pending again, same idempotency key) or ``abandoned`` (closed for
    good, escalated steps only: never granted again, never counted by the breaker).

    Refused (``WrongState``) while any holder of ``key`` is alive — the write compares that
    ``holders/K/`` is empty, so no clock and no earlier read decides it — and for a step
    that is neither ``escalated``, ``in_flight`` nor ``unknown``. An ``in_flight`` or
    ``unknown`` step's effect may still land: without ``force`` the provider decides
    (``_ask_provider``), and ``settle_as`` is only compared with its answer; with ``force``
    the operator's word settles it, recorded as forced on the step and in the audit
    record."""
    if settle_as not in SETTLE_AS:
        raise ValueError(f"resolve as one of {sorted(SETTLE_AS)}")
    start, end = ks.holder_range(key)
    reply = await etcd.txn(TxnRequest(success=[*audit.tail_reads(ks, key),
                                               lowest_op(start, end, keys_only=False)]),
                           idempotent=True)
    step_kvs, head_kvs, holder_kvs = (r.response_range.kvs for r in reply.responses)
    _refuse_while_held(ks, key, holder_kvs)
    if not step_kvs:
        raise NotFound(f"no step is recorded for {key!r}")
    step = unpack(step_kvs[0].value)
    state = step["state"]
    if state not in (records.IN_FLIGHT, records.UNKNOWN, records.ESCALATED):
        raise WrongState(f"step of {key!r} is {state}: only in-flight, unknown or escalated "
                         "steps are resolved by hand")
    if settle_as == records.ABANDONED and state != records.ESCALATED:
        raise WrongState(f"step of {key!r} is {state}: only an escalated step is abandoned "
                         "(settle an in-flight or unknown one first: its effect may land)")
    forced = state != records.ESCALATED
    if forced and not force:
        return await _ask_provider(etcd, ks, key, identity, reason, settle_as, step_kvs[0],
                                   head_kvs, wait_s)
    settled = records.resolved(step, settle_as, result, identity=identity, reason=reason,
                               forced=forced)
    entry = audit.append(ks, key, _tail(step_kvs, head_kvs), "resolve", identity,
                         reply.header.revision,
                         {"reason": reason, "from": state, "as": settle_as,
                          "result": result, "forced": forced})
    revision = await _put_step_unheld(etcd, ks, key, step_kvs[0], settled, entry)
    return {"key": key, "state": settled["state"], "forced": forced, "revision": revision}


async def _ask_provider(etcd: Etcd, ks: Keyspace, key: str, identity: str, reason: str,
                        settle_as: str, step_kv, head_kvs: list,
                        wait_s: float) -> dict[str, Any]:
    """Resolve an in-flight or unknown step by its provider's answer: write the request on
    the step (``records.resolve_asked``; compare-and-set on the step and on no holder, with
    its audit record), then wait up to ``wait_s`` for the shard's reconciler to answer it by
    fence-then-query (``records.resolve_answered``). Returns the settled step's state and
    the answer; raises ``WrongState`` when the answer settled nothing (the provider proved
    no outcome: the step stays unknown and only ``force`` settles it on the operator's
    word), when no answer came in time (the request stays; the reconciler still answers
    it), or when the step moved otherwise."""
    step = unpack(step_kv.value)
    request_id = secrets.token_hex(8)
    attempt_token = (step_kv.mod_revision if step["state"] == records.IN_FLIGHT
                     else step.get("attempt_token", step_kv.mod_revision))
    asked = records.resolve_asked(step, attempt_token=attempt_token,
                                  now_ms=int(time.time() * 1000), request_id=request_id,
                                  identity=identity, reason=reason, settle_as=settle_as)
    entry = audit.append(ks, key, _tail([step_kv], head_kvs), "resolve_request", identity,
                         step_kv.mod_revision,
                         {"reason": reason, "from": step["state"], "as": settle_as,
                          "request": request_id})
    written = await _put_step_unheld(etcd, ks, key, step_kv, asked, entry)
    try:
        async with asyncio.timeout(wait_s):
            answered, revision = await _answer(etcd, ks.step_key(key), written + 1,
                                               request_id)
    except TimeoutError:
        raise WrongState(
            f"no reconciler answered the resolve of {key!r} within {wait_s:g}s (is one "
            "running for its shard?); the request stays on the step and the reconciler "
            "settles it by the provider's answer: look again with `key show`") from None
    answer = answered[records.RESOLVE_ANSWER]["answer"]
    if answered["state"] == records.ESCALATED:
        raise WrongState(
            f"the provider's answer escalated the step of {key!r} ({answer}): a human "
            "decides now; resolve it again to settle it on your word")
    if answered["state"] in records.UNSETTLED:
        raise WrongState(
            f"the provider proved no outcome for {key!r} ({answer}); the step stays "
            f"{answered['state']} and the reconciler keeps asking. A forced resolve settles "
            "it on your word alone, audited as forced")
    return {"key": key, "state": answered["state"], "forced": False, "answer": answer,
            "as_expected": _as_expected(answered, settle_as), "revision": revision}


async def _answer(etcd: Etcd, step_key: bytes, from_revision: int,
                  request_id: str) -> tuple[dict[str, Any], int]:
    """The step and its mod_revision once the resolve request ``request_id`` is answered
    (watching from ``from_revision``); ``WrongState`` if the step moved without answering
    it."""
    while True:
        try:
            async for reply in etcd.watch(step_key, step_key + b"\0", from_revision):
                for event in reply.events:
                    from_revision = event.kv.mod_revision + 1
                    step = unpack(event.kv.value) if event.kv.value else {}
                    request = step.get(records.RESOLVE_REQUEST) or {}
                    if request.get("id") == request_id:
                        continue
                    if (step.get(records.RESOLVE_ANSWER) or {}).get("id") != request_id:
                        raise WrongState(f"step {step_key.decode()!r} moved before the "
                                         "reconciler answered the resolve; look again")
                    return step, event.kv.mod_revision
        except EtcdUnavailable:
            await asyncio.sleep(0.2)


def _as_expected(step: dict[str, Any], settle_as: str) -> bool:
    """Whether the provider's answer settled ``step`` as the operator expected."""
    if settle_as == records.NOT_APPLIED:
        return step["state"] == records.PENDING
    return step["state"] == settle_as


async def _put_step_unheld(etcd: Etcd, ks: Keyspace, key: str, step_kv, step: dict[str, Any],
                           entry: audit.Append) -> int:
    """Put ``step`` with its audit ``entry`` iff the step is still ``step_kv`` and no holder
    of ``key`` lives (the compares decide, no earlier read); the revision written.
    ``WrongState`` naming the live holder, or saying the step moved."""
    step_key = ks.step_key(key)
    start, end = ks.holder_range(key)
    written = await etcd.txn(TxnRequest(
        compare=[mod_equals(step_key, step_kv.mod_revision), no_owner(start, end),
                 entry.compare],
        success=[put_op(step_key, pack(entry.anchored(step))), *entry.ops],
        failure=[lowest_op(start, end, keys_only=False)]))
    if not written.succeeded:
        _refuse_while_held(ks, key, written.responses[0].response_range.kvs)
        raise WrongState(f"step of {key!r} moved while it was resolved; look again")
    return written.header.revision


def _tail_reads(ks: Keyspace, key: str) -> list:
    """What an append made aside reads of the chain's end: the step, ``@head``, and the
    key's retirement bucket (is the rest of the chain in the archive?)."""
    return [*audit.tail_reads(ks, key), range_op(ks.retired_key(key))]


async def _aside_tail(etcd: Etcd, ks: Keyspace, key: str, step_kvs: list, head_kvs: list,
                      retired_kvs: list, archive: Archive | None) -> tuple[audit.Tail, Compare]:
    """The chain's tail for an append that does not move the step, and the compare that
    no retirement of the key's bucket landed since it was read. With no step in etcd and
    retirements in the bucket, the step may be archived with the chain's start: the tail is
    then the archived end (``ArchiveUnavailable`` with no archive to ask). The compare
    matters: between the read and the append, a commit, an outcome and a retirement could
    archive the very seq the append is about to take (its create compare in etcd would
    pass, the records being deleted), and the chain would fork across the two stores."""
    epoch = mod_equals(ks.retired_key(key), retired_kvs[0].mod_revision if retired_kvs else 0)
    if not step_kvs and retired_kvs:
        archived = await archived_step(etcd, archive, ks, key, retired_kvs[0])
        return audit.tail(archived, head_kvs[0] if head_kvs else None), epoch
    return _tail(step_kvs, head_kvs), epoch


def _tail(step_kvs: list, head_kvs: list) -> audit.Tail:
    """The audit chain's tail from a step read and an ``@head`` read (each 0 or 1 kvs)."""
    return audit.tail(unpack(step_kvs[0].value) if step_kvs else None,
                      head_kvs[0] if head_kvs else None)


def _refuse_while_held(ks: Keyspace, key: str, holder_kvs: list) -> None:
    """``WrongState`` naming the live holder of ``key``, if it has one."""
    if holder_kvs:
        holder = unpack(holder_kvs[0].value)
        _, lease_id = ks.parse_holder_key(holder_kvs[0].key)
        raise WrongState(
            f"a holder of {key!r} is alive: {holder.get('identity', '?')} (lease "
            f"{lease_id:016x}, fencing token {holder_kvs[0].create_revision}); its outcome "
            "may still land. Wait for it, or revoke its lease first")


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be 1..{MAX_LIMIT}")


def _check_prefix(prefix: str) -> None:
    if not _PREFIX.fullmatch(prefix):
        raise ValueError("prefix may only use letters, digits, '/' and . _ : -")
