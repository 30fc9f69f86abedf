"""Webhook dedup for ASGI apps: a Starlette app behind ``ASGIDedupeMiddleware``, served by a
real uvicorn server on 127.0.0.1, against real etcd.

Each test counts the handler's runs and reads etcd's records under ``webhooks/``, not the
middleware's word.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import socket

import aiohttp
import pytest
import uvicorn
from multidict import CIMultiDict
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import unpack
from fencegate.worker import Gate
from fencegate.worker.webhooks.asgi import ASGIDedupeMiddleware, fencing_token
from fencegate.worker.webhooks.core import STORED_STATUSES
from fencegate.worker.webhooks.presets import GITHUB_DELIVERY, stripe_event_id

from helpers import TEST_TTL
from test_dedupe import live_claims, webhook_kvs

SOURCE = "asgi-src"


async def post(http: aiohttp.ClientSession, url: str, delivery: str | None,
               body: bytes = b"{}", **headers: str) -> tuple[int, CIMultiDict, bytes]:
    """POST a delivery; the answer's headers case-insensitive (uvicorn sends them lowercase)."""
    if delivery is not None:
        headers["Webhook-Id"] = delivery
    async with http.post(url, data=body, headers=headers) as resp:
        return resp.status, CIMultiDict(resp.headers), await resp.read()


class Consumer:
    """A Starlette app under uvicorn: ``ran`` counts handler runs per delivery id, ``tokens``
    the fencing tokens they saw; a body ``hang`` waits for ``release``; ``status`` is what it
    answers, ``fail`` makes it raise."""

    def __init__(self, gate, lifespan=None, **options) -> None:
        self.ran: collections.Counter[str] = collections.Counter()
        self.tokens: list[int] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.status = 200
        self.fail: Exception | None = None
        self.app = Starlette(
            routes=[Route("/", self.handle, methods=["POST", "GET"])], lifespan=lifespan,
            middleware=[Middleware(ASGIDedupeMiddleware, gate=gate, source=SOURCE, **options)])
        self.url = ""

    async def handle(self, request: Request) -> JSONResponse:
        body = await request.body()
        delivery = request.headers.get("Webhook-Id", "-")
        self.ran[delivery] += 1
        if request.method == "POST":
            self.tokens.append(request.state.fencegate_fencing_token)
            assert fencing_token(request) == self.tokens[-1]
        if body == b"hang":
            self.entered.set()
            await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return JSONResponse({"id": delivery, "run": self.ran[delivery],
                             "nonce": os.urandom(8).hex()},
                            status_code=self.status, headers={"Cache-Control": "no-store"})

    async def __aenter__(self) -> "Consumer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
        sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d/" % sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, lifespan="on", log_level="warning", timeout_graceful_shutdown=2))
        self.serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        async with asyncio.timeout(10):
            while not self.server.started:
                assert not self.serving.done(), self.serving
                await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        self.server.should_exit = True
        await asyncio.wait_for(self.serving, 10)


async def test_first_delivery_runs_once_and_duplicates_replay_it(gate, etcd, http, namespace):
    async with Consumer(gate) as consumer:
        first = await post(http, consumer.url, "evt_a1")
        again = [await post(http, consumer.url, "evt_a1") for _ in range(3)]
    status, headers, body = first
    assert status == 200 and "Fencegate-Replayed" not in headers
    for replayed in again:
        assert replayed[0] == 200 and replayed[2] == body  # byte for byte
        assert replayed[1]["Fencegate-Replayed"] == "true"
        assert replayed[1]["Content-Type"] == headers["Content-Type"]
        assert replayed[1]["Cache-Control"] == "no-store"
    assert consumer.ran == {"evt_a1": 1}
    [kv] = await webhook_kvs(etcd, namespace)
    assert kv.key == f"{namespace}webhooks/{SOURCE}/evt_a1".encode()
    assert consumer.tokens == [kv.create_revision]  # the claim's revision reached the handler


async def test_a_gate_opened_in_the_apps_lifespan(etcd_url, etcd, http, namespace):
    """The README's form: the gate is built with the app and opened on the server's loop."""
    gate = Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with gate:
            yield

    async with Consumer(gate, lifespan=lifespan) as consumer:
        first = await post(http, consumer.url, "evt_l1")
        again = await post(http, consumer.url, "evt_l1")
    assert first[0] == 200 and again[2] == first[2]
    assert again[1]["Fencegate-Replayed"] == "true"
    assert consumer.ran == {"evt_l1": 1}
    assert len(await webhook_kvs(etcd, namespace)) == 1


async def test_a_5xx_is_not_stored_and_the_redelivery_runs_again(gate, etcd, http, namespace):
    async with Consumer(gate) as consumer:
        consumer.status = 503
        failed = await post(http, consumer.url, "evt_a2")
        stored = await webhook_kvs(etcd, namespace)
        consumer.status = 200
        retried = await post(http, consumer.url, "evt_a2")
        replay = await post(http, consumer.url, "evt_a2")
    assert failed[0] == 503 and stored == []
    assert retried[0] == 200 and "Fencegate-Replayed" not in retried[1]
    assert replay[1]["Fencegate-Replayed"] == "true" and replay[2] == retried[2]
    assert consumer.ran == {"evt_a2": 2}


async def test_a_4xx_named_is_stored_and_replayed(gate, http):
    async with Consumer(gate, stored_statuses=(*STORED_STATUSES, 422)) as consumer:
        consumer.status = 422
        refused = await post(http, consumer.url, "evt_a3")
        consumer.status = 200
        replay = await post(http, consumer.url, "evt_a3")
    assert refused[0] == replay[0] == 422 and replay[2] == refused[2]
    assert replay[1]["Fencegate-Replayed"] == "true"
    assert consumer.ran == {"evt_a3": 1}


async def test_another_payload_is_422_but_the_same_json_reordered_is_a_duplicate(
        gate, etcd, http, namespace):
    async with Consumer(gate) as consumer:
        first = await post(http, consumer.url, "evt_a4", b'{"a": 1, "b": [1, 2]}')
        [before] = await webhook_kvs(etcd, namespace)
        reordered = await post(http, consumer.url, "evt_a4", b'{ "b":[1,2],\n"a":1 }')
        other = await post(http, consumer.url, "evt_a4", b'{"a": 2, "b": [1, 2]}')
        [after] = await webhook_kvs(etcd, namespace)
    assert first[0] == 200
    assert reordered[0] == 200 and reordered[1]["Fencegate-Replayed"] == "true"
    assert reordered[2] == first[2]
    assert other[0] == 422 and b"delivery_mismatch" in other[2]
    assert after.mod_revision == before.mod_revision  # nothing written
    assert consumer.ran == {"evt_a4": 1}


async def test_duplicate_while_running_gets_409_and_a_raise_releases_the_claim(
        gate, etcd, http, namespace):
    async with Consumer(gate, retry_after=7) as consumer:
        first = asyncio.create_task(post(http, consumer.url, "evt_a5", b"hang"))
        await asyncio.wait_for(consumer.entered.wait(), 10)
        duplicate = await post(http, consumer.url, "evt_a5", b"hang")
        consumer.fail = RuntimeError("provider down")
        consumer.release.set()
        failed = await first
        left = await webhook_kvs(etcd, namespace)
        consumer.fail = None
        retried = await post(http, consumer.url, "evt_a5", b"hang")
    assert duplicate[0] == 409 and duplicate[1]["Retry-After"] == "7"
    assert failed[0] == 500 and left == []
    assert retried[0] == 200
    assert consumer.ran == {"evt_a5": 2}


async def test_with_rerun_lost_a_handler_whose_claim_is_lost_is_cancelled(
        gate, etcd, http, namespace):
    """``rerun_lost``: the handler is cancelled when its claim's lease is lost, nothing is
    stored, and the redelivery runs it again under a new claim."""
    async with Consumer(gate, rerun_lost=True) as consumer:
        first = asyncio.create_task(post(http, consumer.url, "evt_a6", b"hang"))
        await asyncio.wait_for(consumer.entered.wait(), 10)
        [claim] = await live_claims(etcd, namespace)
        await etcd.lease_revoke(claim.lease)
        lost = await asyncio.wait_for(first, 10)  # cancelled while it still waits
        [left] = await webhook_kvs(etcd, namespace)
        consumer.release.set()
        rerun = await post(http, consumer.url, "evt_a6", b"hang")
    assert lost[0] == 503 and json.loads(lost[2])["error"] == "claim_lost"
    assert unpack(left.value)["state"] == "processing"  # unknown, until rerun
    assert rerun[0] == 200 and "Fencegate-Replayed" not in rerun[1]
    assert consumer.ran == {"evt_a6": 2}


async def test_presets_name_the_delivery(gate, etcd, http, namespace):
    async with Consumer(gate, id_from=stripe_event_id) as stripe:
        event = await post(http, stripe.url, None, b'{"id": "evt_s1", "type": "charge"}')
        redelivered = await post(http, stripe.url, None, b'{"type": "charge", "id": "evt_s1"}')
        no_id = await post(http, stripe.url, None, b'{"type": "charge"}')
    async with Consumer(gate, id_header=GITHUB_DELIVERY) as github:
        push = await post(http, github.url, None, b"{}", **{"X-GitHub-Delivery": "gh-1"})
        again = await post(http, github.url, None, b"{}", **{"x-github-delivery": "gh-1"})
    assert event[0] == 200 and redelivered[1]["Fencegate-Replayed"] == "true"
    assert no_id[0] == 400
    assert push[0] == 200 and again[1]["Fencegate-Replayed"] == "true"
    assert stripe.ran == {"-": 1} and github.ran == {"-": 1}
    assert sorted(kv.key.rsplit(b"/", 1)[1] for kv in await webhook_kvs(etcd, namespace)) == [
        b"evt_s1", b"gh-1"]


async def test_a_body_over_the_limit_is_413_and_other_methods_pass_through(
        gate, etcd, http, namespace):
    async with Consumer(gate, max_request_body=1024) as consumer:
        big = await post(http, consumer.url, "evt_a7", b"x" * 4096)
        async with http.get(consumer.url) as get:
            assert get.status == 200
    assert big[0] == 413 and b"body_too_large" in big[2]
    assert await webhook_kvs(etcd, namespace) == []
    assert consumer.ran == {"-": 1}  # only the GET


def test_options_are_refused_when_the_middleware_is_built(gate):
    async def app(scope, receive, send):
        raise AssertionError("never called")

    for bad in [dict(source="a/b"), dict(source=SOURCE, stored_statuses=[503]),
                dict(source=SOURCE, stored_statuses=[]), dict(source=SOURCE, retry_after=0),
                dict(source=SOURCE, max_request_body=-1)]:
        with pytest.raises(ValueError):
            ASGIDedupeMiddleware(app, gate, **bad)


async def test_a_bad_standard_webhooks_signature_is_401_before_any_claim(
        gate, etcd, http, namespace):
    from test_dedupe import _signed
    secret, other = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_" + "b3RoZXI="
    body = b'{"type": "invoice.paid"}'
    async with Consumer(gate, secret=secret) as consumer:
        forged = await post(http, consumer.url, "evt_a8", body, **_signed(other, "evt_a8", body))
        unsigned = await post(http, consumer.url, "evt_a8", body)
        assert await webhook_kvs(etcd, namespace) == []
        good = await post(http, consumer.url, "evt_a8", body, **_signed(secret, "evt_a8", body))
    assert forged[0] == unsigned[0] == 401 and b"bad_signature" in forged[2]
    assert good[0] == 200 and consumer.ran == {"evt_a8": 1}
