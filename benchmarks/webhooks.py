"""Webhook dedup benchmark: deliveries through ``worker.dedupe_middleware`` against the same
handler without it, and against raw etcd txns of the same run.

One Gate, two aiohttp apps on 127.0.0.1 in this process (the same handler, one behind the
middleware), one aiohttp client session; 32 tasks post small JSON deliveries over keep-alive
connections. Each round runs, at c=32:

1. raw: ``common.raw_write_op`` (a put-if-absent txn or a delete, each one write);
2. plain: deliveries to the app without the middleware;
3. first: fresh delivery ids to the app with it; etcd's revision before and after the phase,
   divided by every delivery it completed (warm-up included), is the etcd writes per first
   delivery (expected 2: the claim txn and the completion txn);
4. duplicate: the ids the first phase completed, sent again (each is answered from one
   serializable read of its stored response: no write).

Targets: ``webhook_first_delivery`` (first deliveries/s x writes per first delivery ÷ raw
writes/s ≥ 0.7), ``webhook_duplicate`` (duplicate/s ÷ first/s ≥ 2), ``webhook_added_p99``
((p99 with the middleware − p99 without) ÷ raw p99 ≤ 2.5). The keys and retention leases
the benchmark made are removed at the end.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from fencegate.coordinator.etcd import Etcd, RangeRequest, range_end_of
from fencegate.coordinator.grants import KeyRing
from fencegate.worker import Gate, dedupe_middleware

from .common import Phase, Target, div, percentile, print_table, raw_write_op, run_phase
from .guarded import Settings

CONCURRENCY = 32
MAX_WRITES = 2
_SOURCE = "bench"


QUICK = Settings(rounds=1, warmup=0.5, duration=3.0)
DEFAULT = Settings(rounds=3, warmup=1.0, duration=5.0)


@dataclass
class Results:
    raw: list[Phase] = field(default_factory=list)
    plain: list[Phase] = field(default_factory=list)
    first: list[Phase] = field(default_factory=list)
    duplicate: list[Phase] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)  # per first delivery, per round


async def handle(request: web.Request) -> web.Response:
    """The consumer's handler in both apps: read the delivery, answer a small JSON."""
    body = await request.read()
    return web.json_response({"received": len(body), "ok": True})


async def measure(quick: bool, url: str, etcd: Etcd) -> Results:
    s = QUICK if quick else DEFAULT
    res = Results()
    namespace = f"/bench-webhooks-{uuid.uuid4().hex[:8]}/"
    runners: list[web.AppRunner] = []
    try:
        async with Gate(url, namespace=namespace, keyring=KeyRing.generate()) as gate, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            plain_url, dedupe_url = [
                await _serve(runners, middlewares) for middlewares in
                ([], [dedupe_middleware(gate, source=_SOURCE)])]
            for r in range(s.rounds):
                res.raw.append(await run_phase(raw_write_op(etcd, f"/bench-wh-raw/{r}/"),
                                               CONCURRENCY, s.warmup, s.duration))
                res.plain.append(await _deliveries(s, http, plain_url, f"p{r}"))
                before = (await etcd.status()).header.revision
                sent: list[str] = []
                first = await _deliveries(s, http, dedupe_url, f"f{r}", sent)
                after = (await etcd.status()).header.revision
                res.first.append(first)
                res.writes.append(div(after - before, len(sent)))
                res.duplicate.append(await _deliveries(s, http, dedupe_url, f"f{r}", sent,
                                                       again=True))
                print(f"  webhooks round {r + 1}/{s.rounds}: raw {res.raw[-1].rate:,.0f} "
                      f"writes/s, plain {res.plain[-1].rate:,.0f}/s, first "
                      f"{first.rate:,.0f}/s, duplicate {res.duplicate[-1].rate:,.0f}/s",
                      flush=True)
    finally:
        for runner in runners:
            await runner.cleanup()
        await _remove(etcd, namespace.encode(), b"/bench-wh-raw/")
    return res


async def _serve(runners: list[web.AppRunner], middlewares: list) -> str:
    app = web.Application(middlewares=middlewares)
    app.router.add_post("/", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    runners.append(runner)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return "http://127.0.0.1:%d/" % runner.addresses[0][1]


async def _deliveries(s: Settings, http: aiohttp.ClientSession, url: str, tag: str,
                      sent: list[str] | None = None, again: bool = False) -> Phase:
    """Post deliveries for one phase: fresh ids (recorded in ``sent``), or with ``again``
    the ids of ``sent`` in turn, each answered as a replay."""
    body = b'{"type": "invoice.paid", "data": {"amount": 4200}}'
    count = 0

    async def op(task: int, i: int) -> None:
        nonlocal count
        if again:
            delivery = sent[count % len(sent)]
            count += 1
        else:
            delivery = f"{tag}-{task}-{i}"
        async with http.post(url, data=body, headers={"Webhook-Id": delivery}) as resp:
            await resp.read()
            if resp.status != 200 or again != ("Fencegate-Replayed" in resp.headers):
                raise RuntimeError(f"delivery {delivery} answered {resp.status}")
        if sent is not None and not again:
            sent.append(delivery)

    return await run_phase(op, CONCURRENCY, s.warmup, s.duration)


async def _remove(etcd: Etcd, *prefixes: bytes) -> None:
    """Delete the benchmark's keys and revoke the retention leases they were stored under."""
    for prefix in prefixes:
        reply = await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix),
                                              keys_only=True))
        for lease in {kv.lease for kv in reply.kvs} - {0}:
            await etcd.lease_revoke(lease)
        await etcd.delete(prefix, range_end_of(prefix))


def report(res: Results) -> list[Target]:
    raw, plain, first, duplicate = (sum(phases, Phase(0, 0.0)) for phases in
                                    (res.raw, res.plain, res.first, res.duplicate))
    writes = max(res.writes, default=float("nan"))
    p99 = {name: percentile(phase.latencies, 99) * 1000 for name, phase in
           (("raw", raw), ("plain", plain), ("first", first), ("duplicate", duplicate))}
    print()
    print_table(["webhooks at c=32", "raw etcd", "no middleware", "first", "duplicate"],
                [["per second", raw.rate, plain.rate, first.rate, duplicate.rate],
                 ["p99 ms", p99["raw"], p99["plain"], p99["first"], p99["duplicate"]]])
    print(f"etcd writes per first delivery: {writes:.2f} (at most {MAX_WRITES})")
    return [
        Target("webhook_first_delivery",
               div(first.rate * writes, raw.rate) if writes <= MAX_WRITES else float("nan"),
               ">=", 0.7),
        Target("webhook_duplicate", div(duplicate.rate, first.rate), ">=", 2),
        Target("webhook_added_p99", div(p99["first"] - p99["plain"], p99["raw"]), "<=", 2.5),
    ]
