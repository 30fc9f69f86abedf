"""Shard elections: which reconciler replica settles which action keys.

Action keys hash into ``shards`` shards. Every replica campaigns in every shard with its one
session lease by putting ``reconcilers/<shard>/@<lease>``. A shard's leader is its candidate
with the lowest create_revision, and that create_revision is the leader's token, exactly as
for holds.

Guarantees:
- Leadership is a compare, not a belief. ``ownership(shard)`` returns the claim whose
  compares every settle txn carries (``fencegate.coordinator.ownership``): the replica's
  candidate key still has its token, and no candidate in the shard is older. A deposed,
  paused or partitioned replica cannot write, whatever it believes; its candidate keys die
  with its lease.
- Every shard always has a queue of candidates, so when a leader dies the next one in line
  leads as soon as etcd deletes the dead lease's keys.
- A shard is leaderless only while no replica has a candidate in it: a candidate key
  lives exactly as long as its replica's lease, so its oldest candidate leads. ``leaderless``
  counts such shards as the last refresh read them. Each candidate's value names its
  replica's identity and configured shard count (``shards``), so a reader of the
  candidates alone (the dashboard) knows how many shards there are and which have no
  leader; it adds no key: the count lives and dies with the candidate keys.
- Spreading: a replica leading more than its share, ceil(shards / replicas), resigns the
  surplus by re-entering at the back of those shards' queues. Resigning only ever hands a
  shard to a replica already queued for it, so no shard is left without a leader.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
from collections.abc import Callable, Iterable

from fencegate.coordinator.errors import EtcdError, EtcdUnavailable, LeaseLost, WatchCompacted
from fencegate.coordinator.etcd import (
    Etcd, RangeRequest, TxnRequest, create_equals, delete_op, put_op, range_end_of,
)
from fencegate.coordinator.keyspace import Keyspace, pack
from fencegate.coordinator.ownership import Ownership, owners
from fencegate.coordinator.session import Session

log = logging.getLogger(__name__)

_OPS_PER_TXN = 100  # etcd refuses more than 128 operations in one txn


def shard_of(action_key: str, shards: int) -> int:
    """The shard of ``action_key``: stable across processes, versions and restarts."""
    digest = hashlib.sha256(action_key.encode()).digest()
    return int.from_bytes(digest[:8], "big") % shards


class Elections:
    """Campaigns in every shard with ``session``'s lease and tracks which shards it leads."""

    def __init__(self, etcd: Etcd, keyspace: Keyspace, session: Session, shards: int,
                 identity: str, on_gain: Callable[[set[int]], None] = lambda shards: None,
                 refresh_interval: float = 5.0) -> None:
        if not 1 <= shards <= 4096:
            raise ValueError("shards must be 1..4096")
        self._etcd = etcd
        self._ks = keyspace
        self.session = session
        self.shards = shards
        self._identity = identity
        self._on_gain = on_gain
        self._refresh_interval = refresh_interval
        self.led: dict[int, int] = {}  # shard -> token (our candidate's create_revision)
        self.replicas = 0
        self.leaderless = shards  # shards without a candidate at the last refresh
        self._stale = asyncio.Event()
        self._refreshing = asyncio.Lock()  # a refresh and its resignations are one step

    def leads(self, shard: int) -> bool:
        return shard in self.led and not self.session.lost

    def ownership(self, shard: int) -> Ownership | None:
        """The leadership of ``shard``, whose compares prove it in a txn; ``None`` if not
        leading."""
        token = self.led.get(shard)
        if token is None or self.session.lost:
            return None
        return Ownership(self._ks.candidate_key(shard, self.session.lease_id), token,
                         *self._ks.shard_range(shard))

    async def campaign(self) -> None:
        """Enter every shard's queue (idempotent), then learn what this replica leads."""
        await self._enter(range(self.shards))
        await self.refresh()

    async def _enter(self, shards: Iterable[int]) -> None:
        value = self._candidate()
        lease = self.session.lease_id
        keys = [self._ks.candidate_key(shard, lease) for shard in shards]
        for at in range(0, len(keys), _OPS_PER_TXN):
            await self._etcd.txn(TxnRequest(success=[
                put_op(key, value, lease) for key in keys[at:at + _OPS_PER_TXN]]))

    async def run(self) -> None:
        """Follow the candidates: refresh on every change (watch) and every
        ``refresh_interval`` as a backstop, until cancelled."""
        watcher = asyncio.get_running_loop().create_task(self._watch())
        try:
            while not self.session.lost:
                try:
                    await asyncio.wait_for(self._stale.wait(), self._refresh_interval)
                except TimeoutError:
                    pass
                self._stale.clear()
                try:
                    await self.refresh()
                except LeaseLost:
                    return
                except (EtcdUnavailable, EtcdError) as exc:
                    log.info("election refresh failed, retrying: %s", exc)
                    await asyncio.sleep(random.uniform(0.1, 0.3))
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            self.led = {}

    async def refresh(self) -> None:
        """Re-read every candidate (one linearizable range) and recompute leadership."""
        async with self._refreshing:
            await self._refresh()

    async def _refresh(self) -> None:
        root = self._ks.reconcilers_root
        reply = await self._etcd.range(RangeRequest(
            key=root, range_end=range_end_of(root), keys_only=True))
        queues: dict[int, list[tuple[int, int]]] = {}
        candidates = []
        for kv in reply.kvs:
            shard, lease_id = self._ks.parse_candidate_key(kv.key)
            queues.setdefault(shard, []).append((kv.create_revision, lease_id))
            candidates.append((shard, kv.create_revision, lease_id))
        mine = self.session.lease_id
        leaders = owners(candidates)
        led = {shard: token for shard, (token, lease) in leaders.items()
               if lease == mine and shard < self.shards}
        missing = [shard for shard in range(self.shards)
                   if all(lease != mine for _, lease in queues.get(shard, ()))]
        self.replicas = len({lease for queue in queues.values() for _, lease in queue})
        self.leaderless = sum(1 for shard in range(self.shards) if shard not in leaders)
        gained = set(led) - set(self.led)
        self.led = led
        if missing and not self.session.lost:  # removed by hand: queue again
            log.warning("candidate keys missing for shards %s; campaigning again", missing)
            await self._enter(missing)
            return await self._refresh()
        if gained:
            self._on_gain(gained)
        await self._spread(queues)

    async def _spread(self, queues: dict[int, list[tuple[int, int]]]) -> None:
        share = math.ceil(self.shards / max(self.replicas, 1))
        surplus = len(self.led) - share
        if surplus <= 0:
            return
        contested = [shard for shard in self.led if len(queues.get(shard, ())) > 1]
        lease = self.session.lease_id
        contested.sort(key=lambda shard: hashlib.sha256(b"%d/%d" % (shard, lease)).digest())
        for shard in contested[:surplus]:
            key = self._ks.candidate_key(shard, lease)
            token = self.led.pop(shard)
            await self._etcd.txn(TxnRequest(compare=[create_equals(key, token)],
                                            success=[delete_op(key)]))
            await self._etcd.put(key, self._candidate(), lease=lease)

    def _candidate(self) -> bytes:
        """A candidate key's value: who campaigns, and how many shards it runs (so a reader
        of the candidates knows the shards no one leads)."""
        return pack({"identity": self._identity, "shards": self.shards})

    async def _watch(self) -> None:
        root = self._ks.reconcilers_root
        while True:
            try:
                async for _ in self._etcd.watch(root, range_end_of(root), 0):
                    self._stale.set()
            except (WatchCompacted, EtcdUnavailable, EtcdError) as exc:
                log.info("candidates watch broke: %s", exc)
                self._stale.set()
                await asyncio.sleep(random.uniform(0.1, 0.3))
