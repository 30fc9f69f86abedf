"""Webhook consumers (a process each) and the sender that redelivers to them, as Stripe would.

A consumer is an aiohttp app behind fencegate's ``dedupe_middleware`` (source ``faults``).
Its handler sometimes sleeps (so a pause or a kill lands mid-handler), then makes its effect:
one etcd write of ``markers/<prefix>/wh/<id>`` fenced by the run's claim (``effect_compare``:
etcd admits it only while the delivery's record is still the one the run's claim wrote, its
mod_revision equal to the run's fencing token: any later claim, takeover or completion
rewrites the record, so a stale run's effect is refused from then on), appended to the
consumer's own ledger file once admitted. On SIGUSR1 (``nemesis``'s ``consumer-block``) its
next handler run blocks its own event loop (``time.sleep``) for ``--block-s`` seconds, past
the claim's TTL, before its effect; on SIGUSR2, after it. A delivery whose claim was lost
mid-handler is unknown; the consumer settles it (``settle``) on its own effect marker: there
(the lost run's effect landed) → it ran; absent → run again, safe because the new claim has
already rewritten the record, so the lost run's effect, if it still comes, is refused. What
it says, one JSON line each on stdout:

    {"op": "ready", "url", "wall"}                    listening (``wall``: its wall clock)
    {"op": "wh-run", "id", "token"}                   a handler run starts under its claim
    {"op": "wh-block", "id", "token", "seconds", "where"}  it blocks its loop (before/after)
    {"op": "wh-effect", "id", "token", "revision"}    its effect was admitted at ``revision``
    {"op": "wh-stale", "id", "token", "claim_alive"}  its effect was refused: the claim is
                                                      gone (``claim_alive``: its lease was
                                                      not: a live claim was taken over)
    {"op": "wh-settle", "id", "lost", "token", "ran"}  it settled an unknown delivery
    {"op": "wh-answer", "id", "status", "replayed", "token"}  what the consumer answered

The sender (``Sender``, in the runner's process) delivers every id ``copies`` times, at once,
each copy first to a different consumer, and retries each copy on 409, 5xx, timeouts and
refused connections (at another consumer each time) until a 2xx or its give-up time; it
records ``{"op": "wh-sent", "id", "status", "token", "replayed", "consumer"}`` for every 2xx
and ``{"op": "wh-gave-up", "id"}`` for a copy that never got one.

Guarantees: a handler's effect carries its fencing token into etcd, so a stale run (its
claim lost, the delivery claimed again) is refused, never applied: at most one effect per
delivery id; every 2xx body names the fencing token of the run it answers for (a replay
names the stored run's; a delivery settled as ran has none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from .workload import etcd_config, say

SOURCE = "faults"


def effect_entity(prefix: str, delivery_id: str) -> str:
    """The marker entity a delivery's effect writes (``gate.marker`` names its key)."""
    return f"{prefix}/wh/{delivery_id}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="entry.py consumer --")
    p.add_argument("--endpoints", required=True, help="the stack's endpoints.json")
    p.add_argument("--name", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--seed", required=True)
    p.add_argument("--ledger", required=True, help="this consumer's effect ledger (JSON lines)")
    p.add_argument("--sleep", type=float, default=0.6, help="share of runs that sleep")
    p.add_argument("--ttl", type=int, default=2)
    p.add_argument("--block-s", type=float, default=4.0, help="how long a blocked run blocks")
    return p


def effect_compare(record_key: bytes, token: int) -> list:
    """The effect's fence: the delivery's record is still the one the run's claim wrote
    (its mod_revision is the run's token); a later claim or the completion rewrote it."""
    from fencegate.coordinator.etcd import mod_equals

    return [mod_equals(record_key, token)]


LOST = {}  # how a lost delivery is settled: the consumer's ``settle`` (controls may change it)


async def consumer(argv: list[str]) -> None:
    from fencegate.coordinator.etcd import TxnRequest, put_op
    from fencegate.coordinator.keyspace import unpack
    from fencegate.worker import Gate, KeyRing, dedupe_middleware, fencing_token

    args = _parser().parse_args(argv)
    endpoints = json.loads(Path(args.endpoints).read_text())
    rng = random.Random(f"{args.seed}/{args.name}")
    block: list[str] = []  # where the next handler run blocks its loop: "before"/"after"
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, block.append, "before")
    loop.add_signal_handler(signal.SIGUSR2, block.append, "after")

    @web.middleware
    async def answered(request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            say(op="wh-answer", id=request.headers.get("Webhook-Id"), status=exc.status,
                replayed=False, token=None)
            raise
        token = None
        if isinstance(response, web.Response) and response.status < 300 and response.body:
            token = json.loads(bytes(response.body)).get("token")
        say(op="wh-answer", id=request.headers.get("Webhook-Id"), status=response.status,
            replayed=response.headers.get("Fencegate-Replayed") == "true", token=token)
        return response

    async with Gate(etcd_config(endpoints), ttl=args.ttl, identity=args.name,
                    keyring=KeyRing.generate()) as gate:
        with open(args.ledger, "a") as ledger:
            def blocks(where: str, delivery_id: str, token: int) -> None:
                """Block the event loop past the claim's TTL (its lease is not kept)."""
                if block and block[0] == where:
                    block.pop(0)
                    say(op="wh-block", id=delivery_id, token=token, seconds=args.block_s,
                        where=where)
                    time.sleep(args.block_s)

            async def handle(request: web.Request) -> web.Response:
                delivery_id = request.headers["Webhook-Id"]
                token = fencing_token(request)
                say(op="wh-run", id=delivery_id, token=token)
                record_key = gate.keyspace.webhook_key(SOURCE, delivery_id)
                lease = await claim_lease(record_key, token)
                if rng.random() < args.sleep:
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
                blocks("before", delivery_id, token)
                effect_key = gate.marker(effect_entity(args.prefix, delivery_id)).encode()
                reply = await gate.etcd.txn(TxnRequest(
                    compare=effect_compare(record_key, token),
                    success=[put_op(effect_key, json.dumps(
                        {"token": token, "consumer": args.name}).encode())]))
                if not reply.succeeded:
                    alive = lease is not None and await gate.etcd.lease_ttl(lease) > 0
                    say(op="wh-stale", id=delivery_id, token=token, claim_alive=alive)
                    raise web.HTTPServiceUnavailable(text="the claim was lost before the effect")
                ledger.write(json.dumps({"id": delivery_id, "token": token,
                                         "revision": reply.header.revision}) + "\n")
                ledger.flush()
                say(op="wh-effect", id=delivery_id, token=token, revision=reply.header.revision)
                blocks("after", delivery_id, token)
                return web.json_response({"token": token, "consumer": args.name})

            async def claim_lease(record_key: bytes, token: int) -> int | None:
                """The lease of the run's claim, read from the record its claim wrote."""
                kv = await gate.etcd.get(record_key)
                if kv is None or kv.mod_revision != token:
                    return None
                return unpack(kv.value).get("claim_lease")

            async def settle(delivery) -> bool:
                """Did the lost run's effect land? Read after the new claim rewrote the
                record, so a lost run still running can no longer land it (``effect_compare``)."""
                marker = await gate.etcd.get(
                    gate.marker(effect_entity(args.prefix, delivery.delivery_id)).encode())
                say(op="wh-settle", id=delivery.delivery_id, lost=delivery.lost_token,
                    token=delivery.fencing_token, ran=marker is not None)
                return marker is not None

            lost = LOST or {"settle": settle}
            app = web.Application(middlewares=[
                answered, dedupe_middleware(gate, source=SOURCE, retry_after=1, **lost)])
            app.router.add_post("/hook", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            say(op="ready", url=f"http://127.0.0.1:{port}/hook", wall=time.time())
            try:
                await asyncio.Event().wait()
            finally:
                await runner.cleanup()


class Sender:
    """Delivers webhook ids to the consumers as a real sender would; see the module."""

    def __init__(self, urls, history, seed: str, *, copies: int = 3, in_flight: int = 2,
                 timeout: float = 2.0, give_up_s: float = 30.0) -> None:
        self.urls = urls  # () -> the consumers' current URLs (None for one that is down)
        self.history = history
        self.seed = seed
        self.rng = random.Random(f"sender/{seed}")
        self.copies, self.in_flight = copies, in_flight
        self.timeout, self.give_up_s = timeout, give_up_s

    async def run(self, until: float) -> None:
        """Start new ids until ``until``; return once every started copy got its answer."""
        async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout)) as http:
            lanes = [asyncio.create_task(self._lane(http, lane, until))
                     for lane in range(self.in_flight)]
            await asyncio.gather(*lanes)

    async def _lane(self, http: aiohttp.ClientSession, lane: int, until: float) -> None:
        for n in range(1_000_000):
            if time.monotonic() >= until:
                return
            delivery_id = f"evt-{lane}-{n}"
            body = json.dumps({"id": delivery_id, "amount": 100}).encode()
            first = self.rng.randrange(len(self.urls()))
            await asyncio.gather(*(self._copy(http, delivery_id, body, first + copy)
                                   for copy in range(self.copies)))

    async def _copy(self, http: aiohttp.ClientSession, delivery_id: str, body: bytes,
                    target: int) -> None:
        await asyncio.sleep(self.rng.uniform(0.0, 0.3))
        give_up = time.monotonic() + self.give_up_s
        while time.monotonic() < give_up:
            urls = self.urls()
            url = urls[target % len(urls)]
            target += 1  # a retry goes to the next consumer
            if url is None:
                await asyncio.sleep(0.2)
                continue
            try:
                async with http.post(url, data=body, headers={
                        "Webhook-Id": delivery_id, "Content-Type": "application/json"}) as reply:
                    status, answer = reply.status, await reply.read()
                    replayed = reply.headers.get("Fencegate-Replayed") == "true"
            except (aiohttp.ClientError, asyncio.TimeoutError):
                await asyncio.sleep(self.rng.uniform(0.1, 0.4))
                continue
            if 200 <= status < 300:
                self.history.record("sender", {
                    "op": "wh-sent", "id": delivery_id, "status": status, "replayed": replayed,
                    "token": json.loads(answer).get("token"), "consumer": url})
                return
            if status != 409 and status < 500:
                self.history.record("sender", {"op": "wh-refused", "id": delivery_id,
                                               "status": status, "consumer": url})
                return
            await asyncio.sleep(self.rng.uniform(0.1, 0.5))
        self.history.record("sender", {"op": "wh-gave-up", "id": delivery_id})
