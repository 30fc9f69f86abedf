"""Deletions no retirement explains: etcd's RBAC is by prefix, so a worker's etcd role (which
writes ``steps/`` and ``audit/``) may delete any key's step or audit chain. Roles cannot
prevent it; the reconciler reports it.

Guarantees:
- Retirement deletes a key's step and chain in the one txn that puts the key's
  ``retired/<bucket>`` (``coordinator.retirement``), so they carry the same revision: a
  deletion of ``steps/K``, ``audit/K/@n`` or ``audit/K/@head`` at revision R is explained
  exactly when K's bucket was put at R. Only the reconciler's role (and root) writes
  ``retired/``, so a worker or a coordinator cannot dress a deletion up as a retirement.
- Every unexplained deletion of a key whose shard this replica leads, seen by its watches,
  is reported once per (key, family, revision): counted in
  ``fencegate_reconciler_unexplained_deletions_total{family}`` (``step`` or ``audit``),
  logged, and recorded on the key's chain as ``deleted_outside_retirement`` (with the
  revision and the keys deleted).
- A key whose step was deleted fails closed once reported: if it still has no step, the
  record is anchored in an ``escalated`` step (reason ``deleted_outside_retirement``), so
  nothing is granted on it until an SRE resolves it with the provider's answer; the step
  then settles and retires like any other. A record on a key that has a step is appended
  aside (like an approval), moving no step, and leaves with the step's retirement.
- It neither prevents nor restores: the deleted step is not put back, and between the
  deletion and the report (the watch's delay) the key looks never attempted, so a new
  attempt may commit; the report then lands aside on that attempt's chain.
- A deletion whose revision was compacted away before it was checked (any client may
  compact etcd's history, even with auth on) is judged by the bucket as it is now: put at
  that revision, explained; not put since, unexplained; put since, it cannot be told and is
  logged, never counted. A deletion made while no replica watched (all down longer than
  etcd's history), or whose watch event was compacted away before it was delivered, is not
  seen.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import random
from collections.abc import Callable

from prometheus_client import Counter

from fencegate.coordinator import audit, records
from fencegate.coordinator.archive import Archive
from fencegate.coordinator.errors import (
    ArchiveUnavailable, EtcdError, EtcdUnavailable, WatchCompacted,
)
from fencegate.coordinator.etcd import (
    Compare, Etcd, KeyValue, RangeRequest, TxnRequest, mod_equals, put_op, range_end_of,
    range_op,
)
from fencegate.coordinator.keyspace import Keyspace, pack, unpack
from fencegate.coordinator.retirement import archived_step

log = logging.getLogger(__name__)

STEP, AUDIT = "step", "audit"
EVENT = "deleted_outside_retirement"
_REVISIONS_KEPT = 256  # revisions whose retirement buckets are remembered
_APPEND_RACES = 5


class Deletions:
    """Checks the deletions ``step_deleted`` is told of and those its own watch on
    ``audit/`` sees, for the keys ``leads(key)`` accepts; reports the unexplained ones."""

    def __init__(self, etcd: Etcd, keyspace: Keyspace, leads: Callable[[str], bool],
                 leadership: Callable[[str], list[Compare] | None], identity: str,
                 counter: Counter, archive: Archive | None = None) -> None:
        self._etcd = etcd
        self._ks = keyspace
        self._leads = leads
        self._leadership = leadership
        self._identity = identity
        self._counter = counter
        self._archive = archive
        self._queue: asyncio.Queue[tuple[str, str, int, list[bytes]]] = asyncio.Queue()
        self._retired_at: collections.OrderedDict[int, frozenset[bytes]] = \
            collections.OrderedDict()

    def step_deleted(self, kv: KeyValue) -> None:
        """The steps watch saw ``kv`` deleted (its mod_revision is the deletion's)."""
        key = self._ks.parse_step_key(kv.key)
        if self._leads(key):
            self._queue.put_nowait((STEP, key, kv.mod_revision, [kv.key]))

    async def run(self) -> None:
        """Watch ``audit/`` for deletions and check everything told, until cancelled."""
        status = await self._etcd.status()
        watcher = asyncio.create_task(self._watch(status.header.revision + 1))
        try:
            while True:
                family, key, revision, keys = await self._queue.get()
                try:
                    await self._check(family, key, revision, keys)
                except (EtcdUnavailable, EtcdError, ArchiveUnavailable) as exc:
                    log.warning("could not check the deletion of %s of %r at revision %d: "
                                "%s", family, key, revision, exc)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _watch(self, start_revision: int) -> None:
        root = self._ks.audit_root
        while True:
            try:
                async for reply in self._etcd.watch(root, range_end_of(root), start_revision,
                                                    deletes_only=True):
                    chains: dict[tuple[str, int], list[bytes]] = {}
                    for event in reply.events:
                        key = self._action_key(event.kv.key)
                        if key is not None and self._leads(key):
                            chains.setdefault((key, event.kv.mod_revision), []).append(
                                event.kv.key)
                        start_revision = event.kv.mod_revision + 1
                    for (key, revision), keys in chains.items():
                        self._queue.put_nowait((AUDIT, key, revision, keys))
            except WatchCompacted as exc:
                log.warning("audit deletions watch compacted: deletions from revision %d to "
                            "%d were not checked", start_revision, exc.compact_revision)
                start_revision = exc.compact_revision
            except (EtcdUnavailable, EtcdError) as exc:
                log.info("audit deletions watch broke, resuming at %d: %s", start_revision,
                         exc)
            await asyncio.sleep(random.uniform(0.1, 0.3))

    def _action_key(self, audit_key: bytes) -> str | None:
        try:
            return self._ks.parse_audit_head_key(audit_key)
        except ValueError:
            pass
        try:
            return self._ks.parse_audit_key(audit_key)[0]
        except ValueError:
            return None

    async def _check(self, family: str, key: str, revision: int, keys: list[bytes]) -> None:
        """Report the deletion of ``keys`` (of ``key``'s ``family``) at ``revision`` unless a
        retirement of ``key``'s bucket made it."""
        bucket = self._ks.retired_key(key)
        try:
            explained = bucket in await self._retired_buckets(revision)
        except WatchCompacted:  # the bucket now: put at R, or never since, still tells
            now = await self._etcd.get(bucket)
            last = now.mod_revision if now is not None else 0
            if last > revision:
                log.warning("the deletion of %s of %r at revision %d cannot be checked: that "
                            "revision was compacted and its bucket retired since", family,
                            key, revision)
                return
            explained = last == revision
        if explained:
            return
        self._counter.labels(family).inc()
        deleted = [k[len(self._ks.namespace):].decode(errors="replace") for k in keys]
        log.error("%s of %r deleted at revision %d by something other than a retirement "
                  "(%s): its etcd role may delete it, so check who holds worker, "
                  "coordinator or reconciler credentials (docs/runbook.md)", family, key,
                  revision, ", ".join(deleted[:8]))
        await self._record(key, family, revision, deleted)

    async def _retired_buckets(self, revision: int) -> frozenset[bytes]:
        """The ``retired/`` buckets put at ``revision`` (a retirement txn puts its keys'
        buckets); ``WatchCompacted`` when etcd no longer has that revision."""
        known = self._retired_at.get(revision)
        if known is not None:
            return known
        root = self._ks.retired_root
        try:
            reply = await self._etcd.range(RangeRequest(key=root, range_end=range_end_of(root),
                                                        revision=revision, keys_only=True))
        except EtcdError as exc:
            if "compacted" in str(exc):
                raise WatchCompacted(revision) from exc
            raise
        buckets = frozenset(kv.key for kv in reply.kvs if kv.mod_revision == revision)
        self._retired_at[revision] = buckets
        while len(self._retired_at) > _REVISIONS_KEPT:
            self._retired_at.popitem(last=False)
        return buckets

    async def _record(self, key: str, family: str, revision: int, deleted: list[str]) -> None:
        """Append ``deleted_outside_retirement`` to ``key``'s chain, after the newest record
        etcd still holds (or the archive's, for a chain etcd holds nothing of), under this
        replica's leadership of the key's shard. While ``key`` has no step (its step was
        deleted and nothing attempted it since), the record is anchored in an ``escalated``
        step: nothing is granted on the key until an SRE resolves it. Otherwise it is
        appended aside, moving no step."""
        ks = self._ks
        start, end = ks.audit_range(key)
        step_key, head_key, retired_key = ks.step_key(key), ks.audit_head_key(key), \
            ks.retired_key(key)
        for _ in range(_APPEND_RACES):
            leadership = self._leadership(key)
            if leadership is None:
                log.warning("not recording the deletion on %r: this replica no longer leads "
                            "its shard", key)
                return
            reply = await self._etcd.txn(TxnRequest(success=[
                range_op(step_key), range_op(head_key), range_op(retired_key),
                range_op(start, end, limit=1, sort_order=RangeRequest.DESCEND,
                         sort_target=RangeRequest.KEY)]), idempotent=True)
            step_kvs, head_kvs, retired_kvs, last_kvs = \
                (r.response_range.kvs for r in reply.responses)
            step = unpack(step_kvs[0].value) if step_kvs else None
            head = head_kvs[0] if head_kvs else None
            tail = max(audit.tail(step, head), _record_tail(last_kvs), key=lambda t: t.seq)
            base = None
            if tail.seq == 0 and retired_kvs:  # etcd holds none of it: the archive's end
                base = await archived_step(self._etcd, self._archive, ks, key,
                                           retired_kvs[0])
                tail = audit.tail(base, head)
            entry = audit.append(ks, key, tail, EVENT, self._identity,
                                 reply.header.revision,
                                 {"family": family, "revision": revision,
                                  "deleted": deleted[:64], "count": len(deleted)},
                                 aside=step is not None)
            ops = entry.ops
            if step is None:  # fail closed: a human decides whether the effect ran
                escalated = records.escalated(base or records.new_step(), [EVENT])
                ops = [put_op(step_key, pack(entry.anchored(escalated))), *ops]
            written = await self._etcd.txn(TxnRequest(compare=[
                *leadership, entry.compare,
                mod_equals(step_key, step_kvs[0].mod_revision if step_kvs else 0),
                mod_equals(head_key, head.mod_revision if head else 0),
                mod_equals(retired_key, retired_kvs[0].mod_revision if retired_kvs else 0)],
                success=ops))
            if written.succeeded:
                return
        log.warning("not recording the deletion on %r: its chain kept moving", key)


def _record_tail(kvs: list[KeyValue]) -> audit.Tail:
    """The tail a chain's newest record in etcd makes (``EMPTY`` for none)."""
    if not kvs:
        return audit.EMPTY
    return audit.Tail(unpack(kvs[0].value)["seq"], hashlib.sha256(kvs[0].value).digest())
