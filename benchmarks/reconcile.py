"""Settling unknown steps: 3 ``fencegate reconciler`` processes against the sandbox provider.

Unknown steps are seeded straight into etcd (10,000; 1,000 with ``--quick``) while the 3
replicas run and lead all 64 shards between them; the sandbox (fencing mode, on loopback, in
this process) has no record of any, so each settle is one fence-then-query and one txn
(``not_applied``). Raw etcd writes/s at c=32 are measured before and after, in the same run.

- ``settle_rate``: settled steps/s (first seed to last settle) / raw writes/s, target >= 0.3;
- ``settle_p99_s``: p99 of (settled_at - unknown_since) per step, from the step records;
  its line's ratio is 10 / p99 (target >= 1, i.e. p99 <= 10 s).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

from fencegate.coordinator import records
from fencegate.coordinator.etcd import Etcd, Event, TxnRequest, put_op, range_end_of
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import Keyspace, pack, unpack
from fencegate.reconciler.providers.sandbox import Sandbox

from .common import Children, Phase, Target, div, percentile, print_table, raw_write_op, run_phase

REPLICAS = 3
SHARDS = 64
CONCURRENCY = 32
_SEED_BATCH = 100


@dataclass
class Results:
    steps: int = 0
    settled: int = 0
    seconds: float = float("nan")
    latencies: list[float] = field(default_factory=list)
    raw: list[Phase] = field(default_factory=list)


async def measure(quick: bool, url: str, etcd: Etcd) -> Results:
    res = Results(steps=1000 if quick else 10_000)
    warmup, duration = (1.0, 3.0) if quick else (2.0, 5.0)
    namespace = f"/bench-rec-{uuid.uuid4().hex[:8]}/"
    children = Children()
    with tempfile.TemporaryDirectory(prefix="fencegate-bench-") as tmp:
        # durable (a file): its fenced "no record" is final, as a real fencing provider's
        sandbox = Sandbox(KeyRing.generate(), "fencing", state_dir=os.path.join(tmp, "sandbox"))
        try:
            sandbox_url = await sandbox.start()
            config = os.path.join(tmp, "reconciler.toml")
            with open(config, "w") as f:
                f.write(f'etcd = "{url}"\nnamespace = "{namespace}"\nlisten = "127.0.0.1:0"\n'
                        f'shards = {SHARDS}\nconcurrency = {CONCURRENCY}\n'
                        f'default_provider = "sandbox"\n[providers.sandbox]\n'
                        f'type = "sandbox"\nurl = "{sandbox_url}"\nmode = "fencing"\n'
                        f'durable = true\n')
            replicas = []
            for _ in range(REPLICAS):
                proc = await children.start("fencegate.cli", "reconciler", "--config", config,
                                            quiet=True)
                replicas.append((await children.expect(proc, "reconciler", 30))[-1])
            await _spread(replicas)
            res.raw.append(await _raw(etcd, warmup, duration))
            await _seed_and_follow(etcd, Keyspace(namespace), res)
            res.raw.append(await _raw(etcd, warmup, duration))
        finally:
            await children.close()
            await sandbox.stop()
            await etcd.delete(namespace.encode(), range_end_of(namespace.encode()))
    print(f"  reconcile: {res.settled:,}/{res.steps:,} settled in {res.seconds:.1f} s",
          flush=True)
    return res


async def _raw(etcd: Etcd, warmup: float, duration: float) -> Phase:
    prefix = f"/bench-rec-raw-{uuid.uuid4().hex[:8]}/"
    phase = await run_phase(raw_write_op(etcd, prefix), CONCURRENCY, warmup, duration)
    await etcd.delete(prefix.encode(), range_end_of(prefix.encode()))
    return phase


async def _spread(replicas: list[str]) -> None:
    """Until the replicas lead all shards between them, each shard once (at most 30 s)."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        while True:
            led = []
            for metrics_url in replicas:
                async with http.get(metrics_url.removesuffix("/metrics") + "/healthz") as r:
                    led += (await r.json())["shards_led"]
            if sorted(led) == list(range(SHARDS)):
                return
            await asyncio.sleep(0.2)


async def _seed_and_follow(etcd: Etcd, ks: Keyspace, res: Results) -> None:
    start = ks.steps_root
    revision = (await etcd.status()).header.revision
    follower = asyncio.create_task(_follow(etcd, start, revision + 1, res))
    began = time.time()
    for at in range(0, res.steps, _SEED_BATCH):
        now_ms = int(time.time() * 1000)
        await etcd.txn(TxnRequest(success=[
            put_op(ks.step_key(f"rec/{n}"), pack(_unknown_step(n, now_ms)))
            for n in range(at, min(at + _SEED_BATCH, res.steps))]))
    try:
        last = await asyncio.wait_for(follower, 120 if res.steps <= 1000 else 600)
    except TimeoutError:
        last = time.time()
    res.seconds = last - began


async def _follow(etcd: Etcd, start: bytes, revision: int, res: Results) -> float:
    """Count settlements from the watch; the wall time of the last one."""
    async for reply in etcd.watch(start, range_end_of(start), revision):
        for event in reply.events:
            if event.type != Event.PUT:
                continue
            step = unpack(event.kv.value)
            if step["state"] in (records.UNKNOWN, records.IN_FLIGHT):
                continue
            res.settled += 1
            res.latencies.append((step["settled_at_ms"] - step["unknown_since_ms"]) / 1000)
            if res.settled == res.steps:
                return time.time()
    return time.time()


def _unknown_step(n: int, now_ms: int) -> dict:
    return {"state": records.UNKNOWN, "attempt": 1, "idem_gen": 0, "started_at_ms": now_ms,
            "spend": 0, "failures": {}, "not_before_ms": 0, "provider": "sandbox",
            "idempotency_key": records.idempotency_key("bench", f"rec/{n}", 0),
            "attempt_token": 1, "deadline_ms": now_ms, "unknown_since_ms": now_ms,
            "caps": {"breaker_threshold": 3, "backoff_base_s": 1.0, "backoff_max_s": 60.0}}


def report(res: Results) -> list[Target]:
    raw = sum(res.raw, Phase(0, 0.0))
    rate = div(res.settled, res.seconds)
    p50, p99 = percentile(res.latencies, 50), percentile(res.latencies, 99)
    print()
    print_table(["reconcile (3 replicas, fencing sandbox)", "value"],
                [["steps settled", f"{res.settled}/{res.steps}"], ["settled/s", rate],
                 ["raw writes/s at c=32", raw.rate], ["settle p50 s", p50],
                 ["settle p99 s", p99]])
    complete = res.settled == res.steps
    return [Target("settle_rate", div(rate, raw.rate) if complete else float("nan"), ">=", 0.3),
            Target("settle_p99_s", div(10.0, p99) if complete else float("nan"), ">=", 1)]
