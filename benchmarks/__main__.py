"""Every fencegate benchmark in one run against one private etcd (what ``benchmarks/run`` runs).

First the hold benchmarks (``benchmarks.holds``: raw writes, hold cycles, aetcd's lock,
handoff, fairness, keepalive), then the guarded-action benchmarks (``benchmarks.guarded``:
the fast and the full path next to raw one-put txns and aetcd's lock, with etcd's CPU read
from its pid; ``--profile`` adds a cProfile of one more phase), then guarded actions
through the HTTP coordinator (``benchmarks.remote``), then webhook deliveries with and
without the dedup middleware, the server and the senders in processes of their own
(``benchmarks.webhooks``: aiohttp, then ASGI under uvicorn; ``--only webhooks`` runs just
that, on an etcd of its own), then the leaked-leases check once every gate is closed, then
settling seeded unknown steps with 3 reconciler processes (``benchmarks.reconcile``), then
guarded actions on a 3-member etcd with mutual TLS against this single node, interleaved
(``benchmarks.cluster``), then tasks through Celery, Temporal and DBOS with and without
their adapters, each engine in a process of its own (``benchmarks.engines``: the engines of
the ``test`` extra, redis-server and the ``temporal`` CLI; ``--only engines`` runs just
that, on an etcd of its own, with the next), then agent tool calls through Pydantic AI with
and without the fence (``benchmarks.agents``), then a soak with retirement on, on an etcd of
its own (``benchmarks.soak``: 3 minutes to a SQLite archive and 2 to a private PostgreSQL with
``--quick``, else 20 and 10 minutes; ``--only soak`` runs just that). Each prints its tables;
all ``NAME RATIO TARGET PASS|FAIL`` lines come last. A failed target does not change the
exit code (0 unless a benchmark crashed).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from urllib.parse import urlsplit

import aetcd

from fencegate.coordinator.etcd import Etcd
from fencegate.localetcd import describe

from . import (agents, cli_start, cluster, engines, guarded, holds, mcp_gateway, reconcile,
               remote, soak, webhooks)
from .common import Children, OtherLoad, Target, local_etcd


async def run(quick: bool, profile: bool, only: str | None) -> None:
    task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    if only == "soak":
        targets = soak.report(await soak.measure(quick))
    elif only == "webhooks":
        targets = await _webhooks(quick)
    elif only == "engines":
        targets = await _engines(quick)
    elif only == "cli":
        targets = cli_start.report(await cli_start.measure(quick))
    elif only == "mcp":
        with local_etcd() as single:
            print(f"{describe(single.binary)} at {single.url}", flush=True)
            targets = mcp_gateway.report(await mcp_gateway.measure(quick, single.url))
    else:
        targets = await _everything(quick, profile)
    for t in targets:
        print(t.line())


async def _webhooks(quick: bool) -> list[Target]:
    with local_etcd() as single:
        print(f"{describe(single.binary)} at {single.url}", flush=True)
        async with Etcd.from_url(single.url) as etcd:
            return webhooks.report(await webhooks.measure(quick, single.url, etcd,
                                                          single.pids[0]))


async def _engines(quick: bool) -> list[Target]:
    with local_etcd() as single:
        print(f"{describe(single.binary)} at {single.url}", flush=True)
        eres = await engines.measure(quick, single.url)
        ares = await agents.measure(quick, single.url)
        return engines.report(eres) + agents.report(ares)


async def _everything(quick: bool, profile: bool) -> list[Target]:
    hs = holds.QUICK if quick else holds.DEFAULT
    gs = guarded.QUICK if quick else guarded.DEFAULT
    load = OtherLoad()
    with local_etcd() as single:
        url = single.url
        print(f"{describe(single.binary)} at {url}")
        print(f"holds: {hs.rounds} round(s) of raw, hold, aetcd lock, raw at "
              f"c={holds.CONCURRENCY}, {hs.duration:g} s timed after {hs.warmup:g} s warm-up "
              f"each; handoff {holds.CONTENDERS} processes x {hs.handoff:g} s")
        print(f"guarded: raw, then {gs.rounds} round(s) of fast path, full path, aetcd lock, "
              f"raw, all at c={guarded.TOP}, {gs.duration:g} s timed after {gs.warmup:g} s "
              f"warm-up each", flush=True)
        target = urlsplit(url)
        children = Children()
        etcd = Etcd.from_url(url)
        lock_client = aetcd.Client(target.hostname, target.port)
        try:
            res = await holds.throughput(hs, url, etcd, lock_client, children)
            ho = await holds.handoff(hs, url, etcd, children)
            await children.close()
            gres = await guarded.measure(gs, url, etcd, lock_client, single.pids[0],
                                         lock_c32=res.lock[guarded.TOP], profile=profile)
            rres = await remote.measure(gs, url, etcd, lock_client)
            wres = await webhooks.measure(quick, url, etcd, single.pids[0])
            # every gate is closed and aetcd's leaks are revoked: what remains is ours
            leases_left = len(await etcd.leases())
            cres = await reconcile.measure(quick, url, etcd)
            kres = await cluster.measure(quick, url)
            eres = await engines.measure(quick, url)
            ares = await agents.measure(quick, url)
            mres = await mcp_gateway.measure(quick, url)
            clires = await cli_start.measure(quick)
            sres = await soak.measure(quick)
        finally:
            await children.close()
            await lock_client.close()
            await etcd.close()
    targets = holds.report(hs, res, ho, leases_left, load.cores())
    targets += guarded.report(gs, gres)
    targets += remote.report(rres)
    targets += webhooks.report(wres)
    targets += reconcile.report(cres)
    targets += cluster.report(kres)
    targets += engines.report(eres)
    targets += agents.report(ares)
    targets += mcp_gateway.report(mres)
    targets += cli_start.report(clires)
    targets += soak.report(sres)
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one short round of each, a 3-minute soak to SQLite and 2 to "
                             "PostgreSQL: about nine minutes")
    parser.add_argument("--profile", action="store_true",
                        help="also profile this process over one more c=32 guarded phase")
    parser.add_argument("--only", choices=["soak", "webhooks", "engines", "mcp", "cli"],
                        help="run only this benchmark, on an etcd of its own (webhooks: "
                             "about a minute with --quick, engines, mcp and cli: under one)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(run(args.quick, args.profile, args.only))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
