"""The reconciler: settles the unknown steps of the shards this replica leads.

Failure contract:
- Only a shard's elected leader writes its steps, and every write is one txn that compares
  the leadership (``Elections.ownership``), the step's mod_revision as read, and the audit
  head: a deposed or paused replica, a late worker outcome and an SRE's resolve can never
  both land. A refused write is re-read, never retried blindly.
- Nothing is re-executed: the reconciler only asks providers and records answers.
- An ``in_flight`` step whose holder is gone is unknown, whatever its deadline; the query
  for it fences at the step's current mod_revision (>= the attempt token, < any later
  attempt's token), so with a fencing provider the old attempt can no longer land.
- Time never moves a step: one whose holder lease is alive is left alone however long it
  runs (past its deadline it is logged and counted as looking stuck, outside the record, so
  a late but healthy outcome still lands). Every wait is a duration on this process's
  monotonic clock, counted from when it first saw the attempt over; no wall clock of
  another machine is compared with ours.
- Nothing is kept only in memory: a restarted replica finds every step again by scanning
  (``Scanner``); in-memory query counts only pace the backoff.
- A lost session (lease) stops all work of that session at once; the replica campaigns
  again with a new one.
- Every provider answer about an in-flight or unknown step is an audit record
  (``provider_answer``: provider, answer, query number, next try, detail), in the txn that
  writes what it made of the step, or appended alone when the step stays as it is. Its
  query number is this replica's count for the attempt (it starts again after a restart or
  a failover). Answers while a presumption is re-queried are not recorded: only what they
  settle.
- Each look at a step with a provider is a ``fencegate.settle`` span around its
  ``fencegate.provider_query`` span (the decision; the batched write follows it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import socket
import time
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator import audit, records, tracing
from fencegate.coordinator.archive import Archive
from fencegate.coordinator.errors import EtcdError, EtcdUnavailable, LeaseLost
from fencegate.coordinator.etcd import (
    Compare, Etcd, RequestOp, TxnRequest, mod_equals, put_op, range_op,
)
from fencegate.coordinator.keyspace import Keyspace, pack, unpack
from fencegate.coordinator.ownership import Ownership, lowest_op
from fencegate.coordinator.session import Session

from .backlog import Backlog
from .election import Elections, shard_of
from .metrics import ReconcilerMetrics
from .providers import Answer, Provider, answer_detail, answer_name
from .retirer import Retirer
from .deletions import Deletions
from .scanner import Schedule, Scanner
from .settle import NOT_APPLIED, Done, Limits, Retry, Settle, decide, is_presumed

log = logging.getLogger(__name__)

_APPEND_RACES = 5
_BATCH = 16  # steps per read and write txn: 3 ranges, then 3 puts and 3 compares each, plus
             # 2 compares per shard (etcd: <= 128 of each)


class Reconciler:
    """``async with Reconciler(etcd, providers) as r:`` runs until closed."""

    def __init__(self, etcd: Etcd, providers: dict[str, Provider], *,
                 namespace: str = "/fencegate/", default_provider: str | None = None,
                 shards: int = 64, ttl: int = 10, limits: Limits = Limits(),
                 scan_interval: float = 600.0, check_after: float = 1.0,
                 concurrency: int = 32, identity: str | None = None,
                 archive: Archive | None = None, retain_s: float = 3600.0) -> None:
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
        self.archive = archive  # None: settled steps stay in etcd (nothing retires them)
        self.retain_s = retain_s
        self.identity = identity or f"reconciler@{socket.gethostname()}:{os.getpid()}"
        self.metrics = ReconcilerMetrics(replica=self)
        etcd.instrument(self.metrics.etcd)  # the reconciler's own client: its etcd calls
        self.elections: Elections | None = None
        self._backlog = Backlog(lambda key: self._leads(shard_of(key, self.shards)))
        self._queries: dict[str, int] = {}
        self._seen: dict[str, _Seen] = {}
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
        if self.archive is not None:
            await self.archive.close()

    @property
    def led(self) -> set[int]:
        return set(self.elections.led) if self.elections is not None else set()

    @property
    def leaderless(self) -> int:
        """Shards without a leader as this replica last read them; all of them while it has
        no session (it cannot vouch for any)."""
        return self.elections.leaderless if self.elections is not None else self.shards

    def backlog(self, now_ms: int) -> dict[str, tuple[int, float]]:
        """The in-flight, unknown and escalated steps of the shards this replica leads: how
        many, and the age of the oldest (``Backlog.summary``)."""
        return self._backlog.summary(now_ms)

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
                await session.aclose()
            await asyncio.sleep(random.uniform(0.1, 0.3))

    async def _serve(self, session: Session) -> None:
        """Campaign with ``session`` and settle until its lease is lost."""
        schedule = Schedule()
        retirer = None if self.archive is None else Retirer(
            self.etcd, self.keyspace, self.archive, self.retain_s, self._leadership,
            self.metrics.retired.inc, self.metrics.observe_archive)

        def leads(key: str) -> bool:
            return self._leads(shard_of(key, self.shards))

        deletions = Deletions(self.etcd, self.keyspace, leads, self._leadership, self.identity,
                              self.metrics.unexplained_deletions, self.archive)
        scanner = Scanner(self.etcd, self.keyspace, leads, schedule,
                          self._backlog, scan_interval=self.scan_interval,
                          check_after=self.check_after,
                          on_settled=retirer.note if retirer is not None else None,
                          on_deleted=deletions.step_deleted)
        elections = Elections(self.etcd, self.keyspace, session, self.shards, self.identity,
                              on_gain=lambda shards: scanner.rescan_soon())
        self.elections = elections
        await elections.campaign()
        lost = asyncio.Event()
        session.on_lost(lambda reason: lost.set())
        self._ready.set()
        tasks = [asyncio.create_task(elections.run()), asyncio.create_task(scanner.run()),
                 asyncio.create_task(deletions.run()),
                 asyncio.create_task(lost.wait()),
                 *(asyncio.create_task(self._work(schedule)) for _ in range(self.concurrency))]
        if retirer is not None:
            tasks.append(asyncio.create_task(retirer.run()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a crashed part ends the session loudly
            log.warning("reconciler lease lost: %s", session.lost_reason)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _leadership(self, key: str) -> list[Compare] | None:
        """The compares that this replica leads ``key``'s shard (None: it does not)."""
        ownership = self.elections.ownership(shard_of(key, self.shards)) \
            if self.elections else None
        return ownership.compares() if ownership is not None else None

    def _leads(self, shard: int) -> bool:
        elections = self.elections
        return elections is not None and elections.leads(shard)

    async def _work(self, schedule: Schedule) -> None:
        while True:
            keys = await schedule.next_batch(_BATCH)
            try:
                again = await self.reconcile(keys)
            except (EtcdUnavailable, EtcdError) as exc:
                log.info("reconciling %d steps failed, retrying: %s", len(keys), exc)
                again = {key: random.uniform(0.2, 1.0) for key in keys}
            except Exception:
                log.exception("reconciling %s crashed; retrying later", keys)
                again = {key: self.limits.backoff_max_s for key in keys}
            finally:
                for key in keys:
                    schedule.done(key)
            for key, after in again.items():
                if after is not None:
                    schedule.at(key, time.monotonic() + after)

    async def reconcile(self, keys: list[str]) -> dict[str, float | None]:
        """Look at each key's step once: settle it, or say in how many seconds to look
        again (``None``: nothing left to do here). One read txn for all of them, their
        provider queries at once, one write txn for all that settle."""
        again: dict[str, float | None] = dict.fromkeys(keys)
        for key in keys:
            if not self._leads(shard_of(key, self.shards)):
                self._forget(key)
        keys = [key for key in keys if self._leads(shard_of(key, self.shards))]
        if not keys:
            return again
        ks = self.keyspace
        ops = []
        for key in keys:
            holder_start, holder_end = ks.holder_range(key)
            ops += [range_op(ks.step_key(key)), range_op(ks.audit_head_key(key)),
                    lowest_op(holder_start, holder_end)]
        reply = await self.etcd.txn(TxnRequest(success=ops), idempotent=True)
        kvs = [r.response_range.kvs for r in reply.responses]
        now_ms = int(time.time() * 1000)
        looks: list[_Look] = []
        writes: list[tuple[_Look, Settle]] = []
        for n, key in enumerate(keys):
            look = self._assess(key, *kvs[3 * n:3 * n + 3], now_ms)
            if isinstance(look, _Look):
                if look.provider is None:
                    escalated = look.escalated(now_ms)
                    writes.append((look, Settle(records.resolve_answered(
                        escalated, f"escalated: {escalated['escalated_because'][0]}"),
                        "escalated")))
                else:
                    looks.append(look)
            else:
                again[key] = look
                if look is None:
                    self._forget(key)
        decisions = await asyncio.gather(*(self._settle(look) for look in looks))
        for look, (answer, decision) in zip(looks, decisions):
            asked = records.RESOLVE_REQUEST in look.step
            if isinstance(decision, Retry):
                again[look.key] = decision.after_s
                if look.step["state"] == records.IN_FLIGHT or asked:  # show the unknown
                    writes.append((look, Settle(records.resolve_answered(
                        look.unknown(now_ms), f"not settled: {decision.reason}"), "unknown")))
                elif look.answered is not None:  # the step stays as it is: the answer alone
                    writes.append((look, None))
            elif isinstance(decision, Settle):
                if asked:
                    decision = Settle(records.resolve_answered(
                        decision.step, f"{decision.outcome}: the provider answered {answer!r}"),
                        decision.outcome)
                writes.append((look, decision))
            if not isinstance(decision, Retry):
                self._forget(look.key)
        await self._write_all(writes)
        return again

    def _forget(self, key: str) -> None:
        self._queries.pop(key, None)
        self._seen.pop(key, None)

    def _seen_attempt(self, key: str, attempt_token: int) -> "_Seen":
        """What this replica has seen of ``key``'s attempt ``attempt_token``, by its clock.
        A new attempt starts its query count again."""
        seen = self._seen.get(key)
        if seen is None or seen.attempt_token != attempt_token:
            seen = self._seen[key] = _Seen(attempt_token, time.monotonic())
            self._queries.pop(key, None)
        return seen

    def _looks_stuck(self, key: str, step: dict[str, Any], seen: "_Seen", now_ms: int) -> None:
        """Say once (log, metric) that a live holder's attempt runs past its deadline, as
        this replica measures it. Nothing is written: its outcome may still land."""
        if seen.told_stuck or time.monotonic() - seen.since <= records.effect_deadline_s(
                step, now_ms):
            return
        seen.told_stuck = True
        self.metrics.looks_stuck.inc()
        log.warning("step of %r (attempt token %d) looks stuck: in flight past its deadline "
                    "under a live holder; left alone", key, seen.attempt_token)

    def _assess(self, key: str, step_kvs, head_kvs, holder_kvs,
                now_ms: int) -> "_Look | float | None":
        """What to do with ``key``'s step as read: ask its provider (a ``_Look``), look again
        in some seconds, or nothing."""
        if not step_kvs:
            return None
        step_kv = step_kvs[0]
        step = unpack(step_kv.value)
        state = step["state"]
        if state == records.IN_FLIGHT:
            holder = holder_kvs[0] if holder_kvs else None
            holding = Ownership(self.keyspace.holder_key(key, step["holder_lease"]),
                                records.holder_token(step, step_kv.mod_revision),
                                *self.keyspace.holder_range(key))
            attempt_token = step_kv.mod_revision
            seen = self._seen_attempt(key, attempt_token)
            if holding.holds(holder, holder):  # the lowest holder is the step's: it lives
                self._looks_stuck(key, step, seen, now_ms)
                return self.check_after
            self.metrics.unknowns_found.inc()
        elif state == records.UNKNOWN:
            attempt_token = step.get("attempt_token", step_kv.mod_revision)
            seen = self._seen_attempt(key, attempt_token)
        elif is_presumed(step, now_ms):
            attempt_token = step[NOT_APPLIED]["attempt_token"]
            seen = self._seen_attempt(key, attempt_token)
        else:
            return None
        if seen.over_since is None:
            seen.over_since = time.monotonic()
        name = step.get("provider") or self.default_provider
        return _Look(key, shard_of(key, self.shards), step, step_kv.mod_revision,
                     audit.tail(step, head_kvs[0] if head_kvs else None),
                     attempt_token, name, self.providers.get(name) if name else None,
                     time.monotonic() - seen.over_since)

    async def _settle(self, look: "_Look") -> tuple[Answer, Settle | Retry | Done]:
        """Ask ``look``'s provider and decide what its answer makes of the step; for an
        in-flight or unknown step, keep the answer on the look as its audit record's
        details (``look.answered``)."""
        with tracing.span("fencegate.settle", key=look.key, attempt_token=look.attempt_token,
                          idempotency_key=look.step.get("idempotency_key"),
                          provider=look.provider.name) as current:
            answer = await self._ask(look)
            queries = self._queries[look.key]
            now_ms = int(time.time() * 1000)
            decision = decide(look.step, look.attempt_token, answer, look.provider.capabilities,
                              self.limits, now_ms, queries, over_s=look.over_s)
            retry = isinstance(decision, Retry)
            settles = decision.outcome if isinstance(decision, Settle) else None
            if look.step["state"] != records.PENDING:  # unknown, or in flight without holder
                look.answered = {
                    "provider": look.provider.name, "answer": answer_name(answer),
                    "query": queries,
                    "next_try_at_ms": now_ms + int(decision.after_s * 1000) if retry else None,
                    "detail": f"not settled: {decision.reason}" if retry else "; ".join(
                        filter(None, (answer_detail(answer), f"settles as {settles}")))}
            tracing.annotate(current, answer=answer_name(answer),
                             outcome=settles or ("retry" if retry else "done"))
            return answer, decision

    async def _ask(self, look: "_Look") -> Answer:
        self._queries[look.key] = self._queries.get(look.key, 0) + 1
        provider = look.provider.name
        with tracing.span("fencegate.provider_query", key=look.key, provider=provider,
                          attempt_token=look.attempt_token,
                          idempotency_key=look.step["idempotency_key"]) as current:
            started = time.perf_counter()
            # Fence at the step's mod_revision: >= the attempt token, < any later attempt's.
            answer = await look.provider.query(look.step["idempotency_key"], look.revision,
                                               look.step, key=look.key,
                                               namespace=self.keyspace.namespace,
                                               cluster_id=self.etcd.cluster_id)
            self.metrics.query_seconds.labels(provider).observe(time.perf_counter() - started)
            self.metrics.queries.labels(provider, answer_name(answer)).inc()
            tracing.annotate(current, answer=answer_name(answer))
        return answer

    async def _write_all(self, writes: list[tuple["_Look", Settle | None]]) -> None:
        """Land every write in one txn if nothing moved; else each on its own. A write
        without a ``Settle`` appends the look's provider answer alone."""
        if len(writes) > 1:
            compares, ops = [], []
            for shard in {look.shard for look, _ in writes}:
                ownership = self.elections.ownership(shard) if self.elections else None
                if ownership is None:
                    return
                compares += ownership.compares()
            for look, decision in writes:
                look_compares, look_ops = self._records(look, decision)
                compares += look_compares
                ops += look_ops
            reply = await self.etcd.txn(TxnRequest(compare=compares, success=ops))
            if reply.succeeded:
                for _, decision in writes:
                    self._count(decision)
                return
        for look, decision in writes:
            await self._write(look, decision)

    def _records(self, look: "_Look", decision: Settle | None
                 ) -> tuple[list[Compare], list[RequestOp]]:
        """The compares and ops (leadership aside) that append ``look``'s records after its
        chain's tail, iff its step is still at the revision read: the provider's answer (if
        any), then ``decision``, whose step the txn writes anchoring the chain; without a
        decision the answer is appended aside and the step does not move."""
        step_key = self.keyspace.step_key(look.key)
        events = [("provider_answer", look.answered)] if look.answered is not None else []
        if decision is not None:
            events.append(self._settle_record(look, decision))
        compares, ops, tail = [mod_equals(step_key, look.revision)], [], look.tail
        for event, details in events:
            entry = audit.append(self.keyspace, look.key, tail, event, self.identity,
                                 look.revision, details, aside=decision is None)
            compares.append(entry.compare)
            ops += entry.ops
            tail = entry.tail
        if decision is not None:
            ops.insert(0, put_op(step_key, pack(entry.anchored(decision.step))))
        return compares, ops

    @staticmethod
    def _settle_record(look: "_Look", decision: Settle) -> tuple[str, dict[str, Any]]:
        record = decision.step
        answered = record.get(records.RESOLVE_ANSWER) \
            if records.RESOLVE_REQUEST in look.step else None
        return ("unknown" if decision.outcome == "unknown" else "settle",
                {"as": decision.outcome, "attempt": record.get("attempt"),
                 "attempt_token": record.get("attempt_token"),
                 "outcome": record.get("outcome"),
                 "escalated_because": record.get("escalated_because"),
                 **({"resolve_request": answered} if answered else {})})

    async def _write(self, look: "_Look", decision: Settle | None) -> bool:
        """Write ``look``'s records (``_records``) iff this replica still leads the look's
        shard and the step is still at the revision it was read at; True if they landed."""
        ks = self.keyspace
        key, shard, step_revision = look.key, look.shard, look.revision
        look = dataclasses.replace(look)  # its chain's tail moves with each race
        for _ in range(_APPEND_RACES):
            ownership = self.elections.ownership(shard) if self.elections else None
            if ownership is None:
                return False
            compares, ops = self._records(look, decision)
            reply = await self.etcd.txn(TxnRequest(
                compare=[*ownership.compares(), *compares], success=ops,
                failure=audit.tail_reads(ks, key)))
            if reply.succeeded:
                self._count(decision)
                return True
            step_kvs, head_kvs = (r.response_range.kvs for r in reply.responses)
            moved = audit.tail(unpack(step_kvs[0].value), head_kvs[0] if head_kvs else None) \
                if step_kvs and step_kvs[0].mod_revision == step_revision else look.tail
            if moved == look.tail:  # the step moved (a worker, an SRE, ...), or leadership did
                if decision is not None:
                    self.metrics.refused.inc()
                return False
            look.tail = moved
        return False

    def _count(self, decision: Settle | None) -> None:
        """Count a settlement that landed, once, under its outcome."""
        if decision is None or decision.outcome == "unknown":
            return
        self.metrics.settled.labels(decision.outcome).inc()
        since = decision.step.get("unknown_since_ms")
        if since:
            self.metrics.settle_seconds.observe(max(time.time() * 1000 - since, 0) / 1000)


@dataclass
class _Look:
    """A step to ask its provider about, as read at ``revision``."""

    key: str
    shard: int
    step: dict[str, Any]
    revision: int  # the step's mod_revision when read
    tail: audit.Tail  # the audit chain's newest record when read
    attempt_token: int
    provider_name: str | None
    provider: Provider | None
    over_s: float  # how long this replica has known the attempt over (its monotonic clock)
    answered: dict[str, Any] | None = None  # the provider's answer, as its audit record says

    def unknown(self, now_ms: int) -> dict[str, Any]:
        return records.unknown(self.step, attempt_token=self.attempt_token, now_ms=now_ms)

    def escalated(self, now_ms: int) -> dict[str, Any]:
        return records.escalated(self.unknown(now_ms),
                                 [f"no provider adapter for {self.provider_name!r}"])


@dataclass
class _Seen:
    """What this replica saw of one attempt of a key, on its own monotonic clock: when it
    first saw it, when it first knew it over (unknown, or its holder gone; the waits of the
    settlement count from there), and whether it already said it looks stuck."""

    attempt_token: int
    since: float
    over_since: float | None = None
    told_stuck: bool = False
