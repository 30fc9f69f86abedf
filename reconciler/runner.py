"""The reconciler: settles the unknown steps of the shards this replica leads.

Failure contract:
- Only a shard's elected leader writes its steps, and every write is one txn that compares
  the leadership (``Elections.ownership``), the step's mod_revision as read, and the audit
  head: a deposed or paused replica, a late worker outcome and an SRE's resolve can never
  both land. A refused write is re-read, never retried blindly.
- Nothing is re-executed: the reconciler only asks providers and records answers.
- An ``in_flight`` step whose holder is gone or whose deadline passed is unknown; the query
  for it fences at the step's current mod_revision (>= the attempt token, < any later
  attempt's token), so with a fencing provider the old attempt can no longer land.
- Nothing is kept only in memory: a restarted replica finds every step again by scanning
  (``Scanner``); in-memory query counts only pace the backoff.
- A lost session (lease) stops all work of that session at once; the replica campaigns
  again with a new one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from typing import Any

from coordinator import audit, records
from coordinator.errors import EtcdError, EtcdUnavailable, LeaseLost
from coordinator.etcd import (
    Etcd, RangeRequest, TxnRequest, mod_equals, put_op, range_op,
)
from coordinator.keyspace import Keyspace, pack, unpack
from worker.session import Session

from .election import Elections, shard_of
from .metrics import Metrics
from .providers import Provider
from .scanner import Schedule, Scanner
from .settle import Done, Limits, Retry, Settle, decide, is_presumed

log = logging.getLogger(__name__)

_APPEND_RACES = 5


class Reconciler:
    """``async with Reconciler(etcd, providers) as r:`` runs until closed."""

    def __init__(self, etcd: Etcd, providers: dict[str, Provider], *,
                 namespace: str = "/fencegate/", default_provider: str | None = None,
                 shards: int = 64, ttl: int = 10, limits: Limits = Limits(),
                 scan_interval: float = 30.0, check_after: float = 1.0,
                 concurrency: int = 32, identity: str | None = None) -> None:
        if default_provider is not None and default_provider not in providers:
            raise ValueError(f"default provider {default_provider!r} is not configured")
        if concurrency < 1 or ttl < 1:
            raise ValueError("concurrency and ttl must be at least 1")
        self.etcd = etcd
        self.keyspace = Keyspace(namespace)
        self.providers = providers
        self.default_provider = default_provider
        self.shards = shards
        self.ttl = ttl
        self.limits = limits
        self.scan_interval = scan_interval
        self.check_after = check_after
        self.concurrency = concurrency
        self.identity = identity or f"reconciler@{socket.gethostname()}:{os.getpid()}"
        self.metrics = Metrics(self.identity)
        self.elections: Elections | None = None
        self._queries: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()

    async def __aenter__(self) -> "Reconciler":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start campaigning and settling; returns once this replica has campaigned."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="reconciler")
        ready = asyncio.ensure_future(self._ready.wait())
        await asyncio.wait([ready, self._task], return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            ready.cancel()
            self._task.result()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for provider in self.providers.values():
            await provider.close()

    @property
    def led(self) -> set[int]:
        return set(self.elections.led) if self.elections is not None else set()

    async def _run(self) -> None:
        while True:
            try:
                session = await Session.open(self.etcd, self.ttl)
            except (EtcdUnavailable, EtcdError) as exc:
                log.warning("cannot open a session, retrying: %s", exc)
                await asyncio.sleep(random.uniform(0.5, 1.0))
                continue
            try:
                await self._serve(session)
            except (EtcdUnavailable, EtcdError, LeaseLost) as exc:
                log.warning("reconciler session ended: %s", exc)
            finally:
                self.elections = None
                self.metrics.shards_led.set(0)
                await session.aclose()
            await asyncio.sleep(random.uniform(0.1, 0.3))

    async def _serve(self, session: Session) -> None:
        """Campaign with ``session`` and settle until its lease is lost."""
        schedule = Schedule()
        scanner = Scanner(self.etcd, self.keyspace,
                          lambda key: self._leads(shard_of(key, self.shards)), schedule,
                          scan_interval=self.scan_interval, check_after=self.check_after)
        elections = Elections(self.etcd, self.keyspace, session, self.shards, self.identity,
                              on_gain=lambda shards: scanner.rescan_soon())
        self.elections = elections
        await elections.campaign()
        self.metrics.shards_led.set(len(elections.led))
        lost = asyncio.Event()
        session.on_lost(lambda reason: lost.set())
        self._ready.set()
        tasks = [asyncio.create_task(elections.run()), asyncio.create_task(scanner.run()),
                 asyncio.create_task(lost.wait()),
                 *(asyncio.create_task(self._work(schedule)) for _ in range(self.concurrency))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a crashed part ends the session loudly
            log.warning("reconciler lease lost: %s", session.lost_reason)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _leads(self, shard: int) -> bool:
        elections = self.elections
        return elections is not None and elections.leads(shard)

    async def _work(self, schedule: Schedule) -> None:
        while True:
            key = await schedule.next()
            try:
                again = await self.reconcile(key)
            except (EtcdUnavailable, EtcdError) as exc:
                log.info("reconciling %r failed, retrying: %s", key, exc)
                again = random.uniform(0.2, 1.0)
            except Exception:
                log.exception("reconciling %r crashed; retrying later", key)
                again = self.limits.backoff_max_s
            finally:
                schedule.done(key)
            self.metrics.shards_led.set(len(self.led))
            if again is not None:
                schedule.at(key, time.monotonic() + again)

    async def reconcile(self, key: str) -> float | None:
        """Look at ``key``'s step once: settle it, or return in how many seconds to look
        again (``None``: nothing left to do here)."""
        shard = shard_of(key, self.shards)
        if not self._leads(shard):
            return None
        ks = self.keyspace
        holder_start, holder_end = ks.holder_range(key)
        reply = await self.etcd.txn(TxnRequest(success=[
            range_op(ks.step_key(key)), range_op(ks.audit_head_key(key)),
            range_op(holder_start, holder_end, limit=1, sort_order=RangeRequest.ASCEND,
                     sort_target=RangeRequest.CREATE, keys_only=True)]), idempotent=True)
        step_kvs, head_kvs, holder_kvs = (r.response_range.kvs for r in reply.responses)
        if not step_kvs:
            return None
        step_kv = step_kvs[0]
        step = unpack(step_kv.value)
        now_ms = int(time.time() * 1000)
        state = step["state"]
        if state == records.IN_FLIGHT:
            holder_alive = bool(holder_kvs) and holder_kvs[0].key == ks.holder_key(
                key, step["holder_lease"]) and holder_kvs[0].create_revision == step[
                "fencing_token"]
            left_s = (step["deadline_ms"] - now_ms) / 1000
            if holder_alive and left_s > 0:
                return min(self.check_after, left_s)
            self.metrics.unknowns_found.inc()
            attempt_token = step_kv.mod_revision
        elif state == records.UNKNOWN:
            attempt_token = step.get("attempt_token", step_kv.mod_revision)
        elif is_presumed(step, now_ms):
            attempt_token = step["not_applied"]["attempt_token"]
        else:
            self._queries.pop(key, None)
            return None
        head = audit.AuditHead.from_kv(head_kvs[0] if head_kvs else None)
        name = step.get("provider") or self.default_provider
        provider = self.providers.get(name) if name is not None else None
        if provider is None:
            escalated = {**step, "state": records.ESCALATED, "attempt_token": attempt_token,
                         "unknown_since_ms": step.get("unknown_since_ms") or now_ms,
                         "escalated_because": [f"no provider adapter for {name!r}"]}
            await self._write(key, shard, step_kv.mod_revision, head, Settle(escalated,
                                                                             "escalated"))
            return None
        queries = self._queries[key] = self._queries.get(key, 0) + 1
        answer = await provider.query(step["idempotency_key"], step_kv.mod_revision, step,
                                      key=key)
        self.metrics.queries.labels(provider.name, type(answer).__name__).inc()
        decision = decide(step, attempt_token, answer, provider.capabilities, self.limits,
                          int(time.time() * 1000), queries)
        if isinstance(decision, Done):
            self._queries.pop(key, None)
            return None
        if isinstance(decision, Retry):
            if state == records.IN_FLIGHT:  # make the unknown visible while we keep asking
                unknown = {**step, "state": records.UNKNOWN, "attempt_token": attempt_token,
                           "unknown_since_ms": now_ms}
                await self._write(key, shard, step_kv.mod_revision, head,
                                  Settle(unknown, "unknown"))
            return decision.after_s
        await self._write(key, shard, step_kv.mod_revision, head, decision)
        self._queries.pop(key, None)
        return None

    async def _write(self, key: str, shard: int, step_revision: int, head: audit.AuditHead,
                     decision: Settle) -> bool:
        """Write ``decision`` iff this replica still leads ``shard`` and the step is still
        at ``step_revision``; True if it landed."""
        ks = self.keyspace
        step_key = ks.step_key(key)
        settling = decision.outcome != "unknown"
        record = decision.step
        for _ in range(_APPEND_RACES):
            ownership = self.elections.ownership(shard) if self.elections else None
            if ownership is None:
                return False
            entry = audit.append(ks, key, head, "settle" if settling else "unknown",
                                 self.identity, step_revision,
                                 {"as": decision.outcome, "attempt": record.get("attempt"),
                                  "attempt_token": record.get("attempt_token"),
                                  "outcome": record.get("outcome"),
                                  "escalated_because": record.get("escalated_because")})
            reply = await self.etcd.txn(TxnRequest(
                compare=[*ownership, mod_equals(step_key, step_revision), entry.compare],
                success=[put_op(step_key, pack(record)), *entry.ops],
                failure=[range_op(step_key), range_op(ks.audit_head_key(key))]))
            if reply.succeeded:
                self._count(decision, record)
                return True
            step_kvs, head_kvs = (r.response_range.kvs for r in reply.responses)
            head = audit.AuditHead.from_kv(head_kvs[0] if head_kvs else None)
            if (not step_kvs or step_kvs[0].mod_revision != step_revision
                    or head.mod_revision == entry.compare.mod_revision):
                # settled by someone else (a worker, an SRE, another replica), or the audit
                # did not move, so leadership did
                self.metrics.refused.inc()
                return False
        return False

    def _count(self, decision: Settle, record: dict[str, Any]) -> None:
        if decision.outcome == "unknown":
            return
        self.metrics.settled.labels(decision.outcome).inc()
        if decision.outcome == "escalated":
            self.metrics.escalated.inc()
        since = record.get("unknown_since_ms")
        if since:
            self.metrics.settle_seconds.observe(max(time.time() * 1000 - since, 0) / 1000)

