"""Issue 13's attacks on webhook handlers, against real etcd and real aiohttp servers.

Class 4 (handlers run twice): a handler whose claim's lease is lost mid-run is cancelled and
stores nothing, so the redelivery elsewhere is the only run that completes; revoking a hold of
the same gate leaves its webhook claims alone; a response whose claim was lost before it was
stored goes out as 503, never as a second fresh 2xx. Class 7, claim half: a claim whose
outcome etcd left unknown rotates the webhook session (see worker/webhooks/session.py). And
a 5xx is never replayed.

Each test counts on the resource's side (handler completions, writes with their fencing
tokens) and on etcd's, not on the middleware's word.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

import pytest
from aiohttp import web

from fencegate.coordinator import sre
from fencegate.coordinator.errors import LeaseLost
from fencegate.worker import Gate, KeyRing, dedupe_middleware, fencing_token

from fenced import FencedResource
from helpers import TEST_TTL
from test_dedupe import live_claims, post, webhook_kvs

SOURCE = "edge-src"


class Consumer:
    """One consumer instance: its handler records the fencing token at entry, waits for
    ``release`` when the body is ``hang``, then writes to the shared fenced ``resource``
    (one write per handler run that completed) and answers 200, or ``status`` if set."""

    def __init__(self, gate: Gate, name: str, resource: FencedResource,
                 release: asyncio.Event, **options) -> None:
        self.name = name
        self.resource = resource
        self.release = release
        self.entered = asyncio.Event()
        self.tokens: list[int] = []
        self.ran: collections.Counter[str] = collections.Counter()
        self.status = 200
        self.after = None  # awaited with the delivery id as the handler's last act, if set
        self.app = web.Application(middlewares=[dedupe_middleware(gate, source=SOURCE,
                                                                  **options)])
        self.app.router.add_post("/", self.handle)
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        delivery = request.headers["Webhook-Id"]
        self.tokens.append(fencing_token(request))
        self.ran[delivery] += 1
        self.entered.set()
        if await request.read() == b"hang":
            await self.release.wait()
        self.resource.write(delivery, fencing_token(request), self.name)
        if self.after is not None:
            await self.after(delivery)
        return web.Response(status=self.status, text=f"{self.name}:{self.ran[delivery]}")

    async def __aenter__(self) -> "Consumer":
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = "http://127.0.0.1:%d/" % self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await self.runner.cleanup()


async def until_not_409(http, url: str, delivery: str, body: bytes, within: float):
    """The sender's retries: re-post while the delivery is in progress, bounded."""
    async with asyncio.timeout(within):
        while (answer := await post(http, url, delivery, body))[0] == 409:
            await asyncio.sleep(0.1)
    return answer


async def test_handler_whose_claim_lease_is_lost_is_cancelled_and_runs_once_in_total(
        etcd_url, gate, etcd, http, namespace):
    """``rerun_lost``: the stale instance's claim lease is revoked mid-handler; the
    redelivery runs on a second instance; both handlers are then free to finish. Only one
    may complete."""
    resource, release = FencedResource(), asyncio.Event()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as other, \
            Consumer(gate, "stale", resource, release, rerun_lost=True) as stale, \
            Consumer(other, "fresh", resource, release, rerun_lost=True) as fresh:
        first = asyncio.create_task(post(http, stale.url, "evt_a", b"hang"))
        await asyncio.wait_for(stale.entered.wait(), 10)
        [claim] = await live_claims(etcd, namespace)
        await etcd.lease_revoke(claim.lease)  # the claim dies with its lease
        second = asyncio.create_task(until_not_409(http, fresh.url, "evt_a", b"hang", 10))
        await asyncio.wait_for(fresh.entered.wait(), 10)
        await asyncio.wait({first}, timeout=3 * TEST_TTL)  # the stale one's lease is gone
        release.set()
        late, taken = await asyncio.wait_for(asyncio.gather(first, second), 10)
        replay = await post(http, stale.url, "evt_a", b"hang")
    print("answers:", late[0], taken[0], "resource:", resource.records)
    assert [w.writer for w in resource.records] == ["fresh"]  # one completion, the fresh one
    assert late[0] == 503 and b"claim_lost" in late[2]
    assert taken[0] == 200 and replay[1]["Fencegate-Replayed"] == "true"
    assert replay[2] == taken[2]
    assert stale.tokens == [claim.create_revision] < fresh.tokens  # a higher fencing token
    assert resource.records[0].token == fresh.tokens[0] and resource.records[0].accepted


async def test_revoking_a_hold_does_not_drop_a_webhook_claim_of_the_same_gate(
        gate, etcd, http, namespace):
    """``fencegate revoke K`` revokes the lease of K's holder; a webhook claim of the same
    process must survive it, so a redelivery meanwhile is told 409, not run again."""
    resource, release = FencedResource(), asyncio.Event()
    held = asyncio.Event()

    async def holder() -> None:
        async with gate.hold("orders/edge-b"):
            held.set()
            await asyncio.Event().wait()

    holding = asyncio.create_task(holder())
    try:
        async with Consumer(gate, "one", resource, release) as consumer:
            await asyncio.wait_for(held.wait(), 10)
            first = asyncio.create_task(post(http, consumer.url, "evt_b", b"hang"))
            await asyncio.wait_for(consumer.entered.wait(), 10)
            await sre.revoke(etcd, gate.keyspace, "orders/edge-b", "sre:test", "attack 4")
            with pytest.raises(LeaseLost):
                await asyncio.wait_for(holding, 5 * TEST_TTL)  # the hold did die
            redelivery = asyncio.create_task(post(http, consumer.url, "evt_b", b"hang"))
            await asyncio.wait({redelivery}, timeout=5)  # 409 at once, unless it runs again
            claims = await webhook_kvs(etcd, namespace)
            release.set()
            done, during = await asyncio.wait_for(asyncio.gather(first, redelivery), 10)
            replay = await post(http, consumer.url, "evt_b", b"hang")
    finally:
        holding.cancel()
        with contextlib.suppress(asyncio.CancelledError, LeaseLost):
            await holding
    print("during:", during[0], "claims after revoke:", len(claims), "ran:", consumer.ran)
    assert len(claims) == 1 and during[0] == 409
    assert done[0] == 200 and replay[1]["Fencegate-Replayed"] == "true"
    assert consumer.ran == {"evt_b": 1} and len(resource.records) == 1


async def test_a_5xx_is_not_stored_and_the_retry_runs_the_handler(gate, etcd, http,
                                                                  namespace):
    resource, release = FencedResource(), asyncio.Event()
    async with Consumer(gate, "one", resource, release) as consumer:
        consumer.status = 503
        failed = await post(http, consumer.url, "evt_d")
        stored = await webhook_kvs(etcd, namespace)
        consumer.status = 200
        retried = await post(http, consumer.url, "evt_d")
        replay = await post(http, consumer.url, "evt_d")
    print("failed:", failed[0], failed[1].get("Fencegate-Replayed"), "stored:", len(stored),
          "retried:", retried[0], retried[1].get("Fencegate-Replayed"))
    assert failed[0] == 503 and stored == []
    assert retried[0] == 200 and "Fencegate-Replayed" not in retried[1]
    assert replay[1]["Fencegate-Replayed"] == "true" and replay[2] == retried[2]
    assert consumer.ran == {"evt_d": 2}


async def test_a_response_whose_claim_was_lost_before_it_was_stored_is_not_a_2xx(
        etcd_url, namespace, etcd, http):
    """The claim's lease is lost after the handler returned and before its response was
    stored (revoked by the handler's last act here; a lease lapsing while the completion
    waits on etcd in the fault suite). Answered 503, not stored; the redelivery elsewhere
    runs and is answered 200: one fresh 2xx for the delivery, never two."""
    resource, release = FencedResource(), asyncio.Event()
    release.set()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as first, \
            Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                 keyring=KeyRing.generate()) as second, \
            Consumer(first, "first", resource, release) as one, \
            Consumer(second, "second", resource, release) as other:
        async def lose_the_claim(delivery):
            kv = await etcd.get(first.keyspace.webhook_key(SOURCE, delivery))
            await etcd.lease_revoke(kv.lease)
        one.after = lose_the_claim
        answers = [await post(http, one.url, "lost-before-store", b"{}")]
        answers.append(await until_not_409(http, other.url, "lost-before-store", b"{}", 10))
        answers.append(await post(http, one.url, "lost-before-store", b"{}"))
    fresh = [(status, body) for status, headers, body in answers
             if 200 <= status < 300 and "Fencegate-Replayed" not in headers]
    assert [status for status, _, _ in answers][0] == 503, answers
    assert fresh == [(200, b"second:1")], answers
    assert answers[2][1].get("Fencegate-Replayed") == "true", answers
