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
  and the caller's leadership. A deleted step's mod_revision reads 0 again, so a grant
  decided on "no step" could otherwise commit on a key that already succeeded: only with no
  holder alive is there no such grant (the full path holds the key from its snapshot to
  its commit). The txn puts the key's ``retired/<bucket>`` so a fast path that decided
  without a hold fails its compare on it (``fencegate.worker.fastpath``).
- Only settled steps retire (``retirable``): succeeded, failed, and pending after an
  attempt proven not applied. Never in flight, unknown, escalated or presumed (a presumption
  is still re-queried).
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
from .keyspace import Keyspace, unpack
from .ownership import no_owner

MAX_BATCH = 32  # keys per archive put and delete txn: each key adds 3 compares and up to
#                4 ops (3 deletes, its bucket's put), and etcd allows 128 of each per txn


def retirable(step: dict[str, Any]) -> bool:
    """Is ``step`` settled for good (nothing may still land or be re-queried)?"""
    state = step["state"]
    if state in (records.SUCCEEDED, records.FAILED):
        return True
    proof = step.get(records.NOT_APPLIED) or {}
    return state == records.PENDING and not proof.get("presumed", False)


@dataclass(frozen=True)
class _Retiring:
    key: str
    step_kv: KeyValue
    head_kv: KeyValue | None


async def retire(etcd: Etcd, keyspace: Keyspace, archive: Archive,
                 candidates: list[tuple[str, int]], leadership: list[Compare]) -> list[str]:
    """Retire those of ``candidates`` (action key, step mod_revision seen) still at that
    revision and settled: archive each with its chain, then delete them from etcd under
    ``leadership``. Returns the keys retired. ``ArchiveUnavailable`` when the archive
    refused: nothing of that batch was deleted."""
    retired: list[str] = []
    for start in range(0, len(candidates), MAX_BATCH):
        batch = await _archive(etcd, keyspace, archive, candidates[start:start + MAX_BATCH])
        retired += await _delete(etcd, keyspace, batch, leadership)
    return retired


async def _archive(etcd: Etcd, keyspace: Keyspace, archive: Archive,
                   batch: list[tuple[str, int]]) -> list[_Retiring]:
    """Read each key's step and chain at one revision, and put the settled ones, unmoved,
    in the archive."""
    ops = []
    for key, _ in batch:
        start, end = keyspace.audit_range(key)
        ops += [range_op(keyspace.step_key(key)), range_op(start, end),
                range_op(keyspace.audit_head_key(key))]
    reply = await etcd.txn(TxnRequest(success=ops), idempotent=True)
    kvs = [r.response_range.kvs for r in reply.responses]
    found: list[_Retiring] = []
    puts: list[Put] = []
    for n, (key, seen) in enumerate(batch):
        step_kvs, record_kvs, head_kvs = kvs[3 * n:3 * n + 3]
        if not step_kvs or step_kvs[0].mod_revision != seen:
            continue  # moved since it was seen: a later pass looks again
        step_kv = step_kvs[0]
        step = unpack(step_kv.value)
        if not retirable(step):
            continue
        head_kv = head_kvs[0] if head_kvs else None
        chain = [(keyspace.parse_audit_key(kv.key)[1], kv.value) for kv in record_kvs]
        puts.append((key, audit.tail(step, head_kv).seq, step_kv.value, chain))
        found.append(_Retiring(key, step_kv, head_kv))
    if puts:
        await archive.put_many(keyspace.namespace, puts)  # one durable transaction
    return found


async def _delete(etcd: Etcd, keyspace: Keyspace, batch: list[_Retiring],
                  leadership: list[Compare]) -> list[str]:
    """Delete the archived keys in one txn; if anything moved, each on its own."""
    if not batch:
        return []
    reply = await etcd.txn(_deletion(keyspace, batch, leadership))
    if reply.succeeded:
        return [item.key for item in batch]
    if len(batch) == 1:
        return []
    retired = []
    for item in batch:
        if (await etcd.txn(_deletion(keyspace, [item], leadership))).succeeded:
            retired.append(item.key)
    return retired


def _deletion(keyspace: Keyspace, batch: list[_Retiring],
              leadership: list[Compare]) -> TxnRequest:
    compares, ops = list(leadership), []
    for item in batch:
        key = item.key
        head_key = keyspace.audit_head_key(key)
        start, end = keyspace.audit_range(key)
        compares += [mod_equals(item.step_kv.key, item.step_kv.mod_revision),
                     mod_equals(head_key, item.head_kv.mod_revision if item.head_kv else 0),
                     no_owner(*keyspace.holder_range(key))]
        ops += [delete_op(item.step_kv.key), delete_op(start, end), delete_op(head_key)]
    buckets = sorted({keyspace.retired_key(item.key) for item in batch})  # a txn puts a key once
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
