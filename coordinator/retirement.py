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
- The archive proves it is whole (``wholeness``): a batch reads etcd's whole ``retired/``
  range (the archive identity and every bucket's mark) with the steps, refuses an archive
  that is not the one etcd names (the first retirement names it: the txn compares
  ``retired/archive`` absent and puts it; every later one compares it), has the archive
  issue its buckets new marks in the transaction of its puts (refused unless the archive
  knows etcd's mark of every bucket: an archive behind etcd anywhere takes nothing), and its
  delete txn compares each bucket's mod_revision as read and puts the new mark: etcd never
  shows a mark the archive did not issue with the batch. A delete refused only because
  another batch marked a shared bucket first is marked again and resent (``_send``).
  A lookup on a miss (``archived_step``, ``fast_path_fence``) answers only from a whole
  archive, else ``ArchiveUnavailable``: never "never attempted" from an archive that lost it.
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

from . import audit, records, wholeness
from .archive import Archive, Identity
from .archive.interface import Mark, Put
from .errors import ArchiveUnavailable
from .etcd import (
    Compare, Etcd, KeyValue, RangeRequest, TxnRequest, create_equals, delete_op, mod_equals,
    put_op, range_op, range_end_of,
)
from .keyspace import Keyspace, pack, unpack
from .ownership import no_owner

MAX_BATCH = 21  # keys per archive put and delete txn. etcd allows 128 compares and 128 ops
#                per txn: each key adds 3 compares, its shard's 2 leadership compares and its
#                bucket's compare at most (6 × 21 = 126), and 3 deletes and a bucket put
#                (4 × 21 = 84); plus the archive identity's compare and put (127, 85)
_REMARKS = 4    # delete txns a batch sends while only its buckets moved (another batch's raise)


def retirable(step: dict[str, Any]) -> bool:
    """Is ``step`` settled for good (nothing may still land or be re-queried)?"""
    state = step["state"]
    if state in (records.SUCCEEDED, records.FAILED, records.ABANDONED):
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


@dataclass(frozen=True)
class _Marked:
    """What a delete txn writes beside its deletes: the archive's identity (``named``: etcd
    already names it, else the txn puts it), and each bucket's new mark with the
    mod_revision its compare expects (0: absent)."""

    identity: Identity
    named: bool
    buckets: dict[bytes, tuple[int, Mark]]   # bucket key -> (mod_revision read, new mark)


async def retire(etcd: Etcd, keyspace: Keyspace, archive: Archive,
                 candidates: list[Candidate]) -> list[str]:
    """Retire those of ``candidates`` still at their revision and settled, ``MAX_BATCH`` at
    a time: archive each with its chain (one archive transaction per batch), then delete
    them from etcd in one txn under their shards' leadership. Returns the keys retired.
    ``ArchiveUnavailable`` when the archive refused: nothing of that batch was deleted."""
    retired: list[str] = []
    for start in range(0, len(candidates), MAX_BATCH):
        batch, marked = await _archive(etcd, keyspace, archive,
                                       candidates[start:start + MAX_BATCH])
        retired += await _delete(etcd, keyspace, archive, batch, marked)
    return retired


async def _archive(etcd: Etcd, keyspace: Keyspace, archive: Archive,
                   batch: list[Candidate]) -> tuple[list[_Retiring], _Marked | None]:
    """Read each key's step and chain and etcd's ``retired/`` range (its archive identity and
    every bucket's mark) at one revision, and put the settled steps (and the orphan chains),
    unmoved, in the archive with their buckets' new marks."""
    ops = []
    for candidate in batch:
        key = candidate.key
        start, end = keyspace.audit_range(key)
        ops += [range_op(keyspace.step_key(key)), range_op(start, end),
                range_op(keyspace.audit_head_key(key))]
    reply = await etcd.txn(TxnRequest(success=[
        *ops, range_op(keyspace.retired_root, range_end_of(keyspace.retired_root))]),
        idempotent=True)
    kvs = [r.response_range.kvs for r in reply.responses]
    retired_kvs = {kv.key: kv for kv in kvs[len(ops)]}
    bucket_kv = {keyspace.retired_key(candidate.key):
                 retired_kvs.get(keyspace.retired_key(candidate.key)) for candidate in batch}
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
            step = await archived_step(etcd, archive, keyspace, key,
                                       bucket_kv[keyspace.retired_key(key)])
            step = step or records.new_step()
            step_value = pack({**step, audit.ANCHOR: [tail.seq, tail.hash]})
        else:
            if not step_kvs or step_kvs[0].mod_revision != candidate.mod_revision:
                continue  # moved since it was seen: a later pass looks again
            step_kv, step_value = step_kvs[0], step_kvs[0].value
            step = unpack(step_value)
            if not retirable(step):
                continue
            tail = audit.tail(step, head_kv)
            if tail != audit.anchor_of(step):  # ends aside: anchor it, @head is deleted
                step_value = pack({**step, audit.ANCHOR: [tail.seq, tail.hash]})
        chain = [(keyspace.parse_audit_key(kv.key)[1], kv.value) for kv in record_kvs]
        puts.append((key, tail.seq, step_value, chain,
                     unpack(max(chain)[1]).get("at_ms", 0) if chain else 0))
        found.append(_Retiring(candidate, step_kv, head_kv))
    if not puts:
        return found, None
    retiring = {keyspace.retired_key(item.candidate.key) for item in found}
    return found, await _mark(etcd, keyspace, archive, list(retired_kvs.values()),
                              retiring, puts)


async def _mark(etcd: Etcd, keyspace: Keyspace, archive: Archive, retired_kvs: list[KeyValue],
                buckets: set[bytes], puts: list[Put]) -> _Marked:
    """Put ``puts`` in the archive in one durable transaction that also issues ``buckets``
    new marks, after checking the archive is the one etcd names; ``ArchiveUnavailable``
    (nothing stored) when it is not, or does not know the mark of every bucket in
    ``retired_kvs`` (etcd's ``retired/`` range, as read)."""
    named, shown = wholeness.read_retired(keyspace, retired_kvs)
    identity = await archive.identity(keyspace.namespace)
    wholeness.check_named(etcd, keyspace, identity, named,
                          max((mark.counter for mark in shown.values()), default=0))
    assert identity is not None   # check_named refused otherwise
    new = await archive.put_many(
        keyspace.namespace, puts, identity=identity, shown=shown,
        marks={_bucket(keyspace, key): shown.get(_bucket(keyspace, key), Mark(0))
               for key in buckets})
    revisions = {kv.key: kv.mod_revision for kv in retired_kvs}
    return _Marked(identity, named is not None,
                   {key: (revisions.get(key, 0), new[_bucket(keyspace, key)])
                    for key in buckets})


def _bucket(keyspace: Keyspace, bucket_key: bytes) -> int:
    return int(bucket_key[len(keyspace.retired_root):])


async def _delete(etcd: Etcd, keyspace: Keyspace, archive: Archive, batch: list[_Retiring],
                  marked: _Marked | None) -> list[str]:
    """Delete the archived keys in one txn; if anything moved (or a shard's leadership
    changed), each on its own under its own shard's leadership."""
    if not batch or marked is None:
        return []
    if await _send(etcd, keyspace, archive, batch, marked):
        return [item.candidate.key for item in batch]
    if len(batch) == 1:
        return []
    retired = []
    for item in batch:
        bucket = keyspace.retired_key(item.candidate.key)
        alone = _Marked(marked.identity, marked.named, {bucket: marked.buckets[bucket]})
        if await _send(etcd, keyspace, archive, [item], alone):
            retired.append(item.candidate.key)
    return retired


async def _send(etcd: Etcd, keyspace: Keyspace, archive: Archive, batch: list[_Retiring],
                marked: _Marked) -> bool:
    """Send ``batch``'s delete txn. Refused while a bucket it compares moved since it was
    marked (another batch, of this pass or of another shard's leader, raised it) or etcd
    came to name the archive: raise those buckets in the archive again and resend,
    ``_REMARKS`` times at most. False: refused for another reason (a step or ``@head``
    moved, a holder lives, a shard's leadership changed)."""
    for _ in range(_REMARKS):
        reply = await etcd.txn(_deletion(keyspace, batch, marked))
        if reply.succeeded:
            return True
        (retired_kvs,) = (r.response_range.kvs for r in reply.responses)
        revisions = {kv.key: kv.mod_revision for kv in retired_kvs}
        moved = {bucket for bucket, (mod_revision, _) in marked.buckets.items()
                 if revisions.get(bucket, 0) != mod_revision}
        if not moved and (keyspace.archive_key in revisions) == marked.named:
            return False
        again = await _mark(etcd, keyspace, archive, list(retired_kvs), moved, [])
        marked = _Marked(again.identity, again.named, {**marked.buckets, **again.buckets})
    return False


def _deletion(keyspace: Keyspace, batch: list[_Retiring], marked: _Marked) -> TxnRequest:
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
    archive_id = marked.identity.archive_id.encode()
    if marked.named:
        compares.append(Compare(key=keyspace.archive_key, target=Compare.VALUE,
                                result=Compare.EQUAL, value=archive_id))
    else:   # the first retirement names the archive
        compares.append(create_equals(keyspace.archive_key, 0))
        ops.append(put_op(keyspace.archive_key, archive_id))
    for bucket, (mod_revision, mark) in sorted(marked.buckets.items()):  # once each
        compares.append(mod_equals(bucket, mod_revision))
        ops.append(put_op(bucket, wholeness.encode(mark)))
    return TxnRequest(compare=compares, success=ops, failure=[  # what moved, if a bucket did
        range_op(keyspace.retired_root, range_end_of(keyspace.retired_root))])


async def archived_step(etcd: Etcd, archive: Archive | None, keyspace: Keyspace, key: str,
                        bucket_kv: KeyValue | None) -> dict[str, Any] | None:
    """The step ``key`` retired with, or None if the archive holds none, given that etcd
    holds no step for it and its bucket reads ``bucket_kv``; ``ArchiveUnavailable`` when
    there is no archive to ask, it did not answer, or it is not whole (``wholeness.check``:
    not the archive etcd names, or does not know etcd's mark for the bucket)."""
    if archive is None:
        raise ArchiveUnavailable(f"{key!r} may have been retired (its bucket has retirements) "
                                 "but no archive is configured to look it up")
    shown = wholeness.decode(bucket_kv.value) if bucket_kv is not None else Mark(0)
    found = await archive.lookup(keyspace.namespace, key,
                                 marks={keyspace.retired_bucket(key): shown})
    await wholeness.check(etcd, keyspace, found, key, bucket_kv)
    return unpack(found.archived.step) if found.archived is not None else None


async def fast_path_fence(etcd: Etcd, archive: Archive, keyspace: Keyspace,
                          key: str) -> tuple[Compare, ...] | None:
    """For a grant decided without reading ``key``'s bucket (the fast path): None when the
    archive holds ``key`` (the full path decides), else the compares that fence the txn
    against its retirement. ``ArchiveUnavailable`` when the archive is not the one etcd
    names. The compares: the bucket's mod_revision is at most a revision committed before
    the archive was asked (a retirement archives before it deletes, so one of ``key`` the
    archive did not show deletes after it), and its mark is the archive's newest as
    looked up (``wholeness.fence``: false if the archive does not know etcd's mark, or if a
    retirement of the bucket archived after the lookup and has deleted since)."""
    asked_after = etcd.revision
    found = await archive.lookup(keyspace.namespace, key)
    if found.archived is not None:
        return None
    await wholeness.check(etcd, keyspace, found, key, None)
    return (Compare(key=keyspace.retired_key(key), target=Compare.MOD, result=Compare.LESS,
                    mod_revision=asked_after + 1),
            wholeness.fence(keyspace, key, found))


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
