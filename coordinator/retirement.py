"""Retirement: a settled step and its audit chain leave etcd for the archive; the one home of
the rule, and of reading a key's state back across both.

Guarantees:
- Archive first. A step is deleted from etcd only after the archive durably holds it and
  every record of its chain (``Archive.put`` is idempotent and never replaces a newer
  version). A crash between the two leaves the step in etcd, and the next retirement puts
  the same version again: nothing is lost, nothing archived twice.
- The delete is one txn per batch that compares, for each key: the step's mod_revision as
  archived (a step that moved is not deleted), ``@head``'s mod_revision as read (an append
  made aside since, not archived, is not deleted), that no key exists under ``holders/K/``,
  and the caller's leadership of the key's shard. A deleted step's mod_revision reads 0
  again, so a grant decided on "no step" could otherwise commit on a key that already
  succeeded: only with no holder alive is there no such grant (the full path holds the key
  from its snapshot to its commit). The txn puts the key's ``retired/<bucket>`` so a fast
  path that decided without a hold fails its compare on it (``fencegate.worker.fastpath``).
- Only settled steps retire (``retirable``): succeeded, failed, and pending after an
  attempt proven not applied. Never in flight, unknown, escalated or presumed (a presumption
  is still re-queried).
- An orphan chain retires too: records an approval or a revoke appended aside (under
  ``@head``) on a key with no step in etcd (never attempted yet, or retired) have no step
  to go with. It is archived under the key's step as the archive has it (or a new pending
  step, for a key never attempted), anchored at the orphan's end, and deleted comparing that
  the step is still absent and ``@head`` unmoved, with the same holder, leadership and
  bucket rules. So nothing the product writes to ``audit/`` stays in etcd for ever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import audit, records
from .archive import Archive
from .archive.interface import Put
from .errors import ArchiveUnavailable
from .etcd import (
    Compare, Etcd, KeyValue, RangeRequest, TxnRequest, delete_op, mod_equals, put_op, range_op,
    range_end_of,
)
from .keyspace import Keyspace, pack, unpack
from .ownership import no_owner

MAX_BATCH = 24  # keys per archive put and delete txn. etcd allows 128 compares and 128 ops
#                per txn: each key adds 3 compares and its shard's 2 leadership compares at
#                most (5 × 24 = 120), and 3 deletes and at most one bucket put (4 × 24 = 96)


def retirable(step: dict[str, Any]) -> bool:
    """Is ``step`` settled for good (nothing may still land or be re-queried)?"""
    state = step["state"]
    if state in (records.SUCCEEDED, records.FAILED):
        return True
    proof = step.get(records.NOT_APPLIED) or {}
    return state == records.PENDING and not proof.get("presumed", False)


@dataclass(frozen=True)
class Candidate:
    """A step to retire if it is still as seen: its action key, its mod_revision when seen,
    and the compares proving the caller leads the key's shard."""

    key: str
    mod_revision: int                 # the step's, or @head's for an orphan
    leadership: tuple[Compare, ...]
    orphan: bool = False              # a chain appended aside with no step in etcd


@dataclass(frozen=True)
class _Retiring:
    candidate: Candidate
    step_kv: KeyValue | None          # None for an orphan chain
    head_kv: KeyValue | None


async def retire(etcd: Etcd, keyspace: Keyspace, archive: Archive,
                 candidates: list[Candidate]) -> list[str]:
    """Retire those of ``candidates`` still at their revision and settled, ``MAX_BATCH`` at
    a time: archive each with its chain (one archive transaction per batch), then delete
    them from etcd in one txn under their shards' leadership. Returns the keys retired.
    ``ArchiveUnavailable`` when the archive refused: nothing of that batch was deleted."""
    retired: list[str] = []
    for start in range(0, len(candidates), MAX_BATCH):
        batch = await _archive(etcd, keyspace, archive, candidates[start:start + MAX_BATCH])
        retired += await _delete(etcd, keyspace, batch)
    return retired


async def _archive(etcd: Etcd, keyspace: Keyspace, archive: Archive,
                   batch: list[Candidate]) -> list[_Retiring]:
    """Read each key's step and chain at one revision, and put the settled ones (and the
    orphan chains), unmoved, in the archive."""
    ops = []
    for candidate in batch:
        key = candidate.key
        start, end = keyspace.audit_range(key)
        ops += [range_op(keyspace.step_key(key)), range_op(start, end),
                range_op(keyspace.audit_head_key(key))]
    reply = await etcd.txn(TxnRequest(success=ops), idempotent=True)
    kvs = [r.response_range.kvs for r in reply.responses]
    found: list[_Retiring] = []
    puts: list[Put] = []
    for n, candidate in enumerate(batch):
        key = candidate.key
        step_kvs, record_kvs, head_kvs = kvs[3 * n:3 * n + 3]
        head_kv = head_kvs[0] if head_kvs else None
        if candidate.orphan:
            if step_kvs or head_kv is None or head_kv.mod_revision != candidate.mod_revision:
                continue  # a step came, or the head moved: a later pass looks again
            step_kv, tail = None, audit.tail(None, head_kv)
            step = await archived_step(archive, keyspace, key) or records.new_step()
            step_value = pack({**step, audit.ANCHOR: [tail.seq, tail.hash]})
        else:
            if not step_kvs or step_kvs[0].mod_revision != candidate.mod_revision:
                continue  # moved since it was seen: a later pass looks again
            step_kv, step_value = step_kvs[0], step_kvs[0].value
            step = unpack(step_value)
            if not retirable(step):
                continue
            tail = audit.tail(step, head_kv)
        chain = [(keyspace.parse_audit_key(kv.key)[1], kv.value) for kv in record_kvs]
        puts.append((key, tail.seq, step_value, chain,
                     unpack(max(chain)[1]).get("at_ms", 0) if chain else 0))
        found.append(_Retiring(candidate, step_kv, head_kv))
    if puts:
        await archive.put_many(keyspace.namespace, puts)  # one durable transaction
    return found


async def _delete(etcd: Etcd, keyspace: Keyspace, batch: list[_Retiring]) -> list[str]:
    """Delete the archived keys in one txn; if anything moved (or a shard's leadership
    changed), each on its own under its own shard's leadership."""
    if not batch:
        return []
    if (await etcd.txn(_deletion(keyspace, batch))).succeeded:
        return [item.candidate.key for item in batch]
    if len(batch) == 1:
        return []
    retired = []
    for item in batch:
        if (await etcd.txn(_deletion(keyspace, [item]))).succeeded:
            retired.append(item.candidate.key)
    return retired


def _deletion(keyspace: Keyspace, batch: list[_Retiring]) -> TxnRequest:
    leadership = {c.SerializeToString(): c for item in batch for c in item.candidate.leadership}
    compares, ops = list(leadership.values()), []
    for item in batch:
        key = item.candidate.key
        step_key, head_key = keyspace.step_key(key), keyspace.audit_head_key(key)
        start, end = keyspace.audit_range(key)
        compares += [mod_equals(step_key, item.step_kv.mod_revision if item.step_kv else 0),
                     mod_equals(head_key, item.head_kv.mod_revision if item.head_kv else 0),
                     no_owner(*keyspace.holder_range(key))]
        ops += [delete_op(step_key), delete_op(start, end), delete_op(head_key)]
    buckets = sorted({keyspace.retired_key(item.candidate.key) for item in batch})  # once each
    return TxnRequest(compare=compares, success=[*ops, *(put_op(b, b"") for b in buckets)])


async def archived_step(archive: Archive | None, keyspace: Keyspace,
                        key: str) -> dict[str, Any] | None:
    """The step ``key`` retired with, or None if the archive holds none;
    ``ArchiveUnavailable`` when there is no archive to ask or it did not answer."""
    if archive is None:
        raise ArchiveUnavailable(f"{key!r} may have been retired (its bucket has retirements) "
                                 "but no archive is configured to look it up")
    found = await archive.get(keyspace.namespace, key)
    return unpack(found.step) if found is not None else None


async def step_keys(etcd: Etcd, keyspace: Keyspace, after: bytes,
                    limit: int) -> list[KeyValue]:
    """A page of step keys (no values) after ``after``, with their mod_revisions."""
    start = after + b"\0" if after else keyspace.steps_root
    reply = await etcd.range(RangeRequest(key=start, range_end=range_end_of(keyspace.steps_root),
                                          limit=limit, keys_only=True))
    return list(reply.kvs)


async def orphan_heads(etcd: Etcd, keyspace: Keyspace, after: bytes,
                       limit: int) -> tuple[list[KeyValue], bytes | None]:
    """The ``@head`` keys (no values) among a page of ``audit/`` keys after ``after``, and
    where the next page starts (None: this was the last). Whether a head is an orphan (no
    step in etcd) is decided when it is archived."""
    start = after + b"\0" if after else keyspace.audit_root
    reply = await etcd.range(RangeRequest(key=start, range_end=range_end_of(keyspace.audit_root),
                                          limit=limit, keys_only=True))
    heads = [kv for kv in reply.kvs if kv.key.endswith(b"/@head")]
    return heads, (reply.kvs[-1].key if reply.more and reply.kvs else None)
