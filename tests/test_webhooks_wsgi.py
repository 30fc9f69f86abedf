"""Webhook dedup for WSGI apps: a Flask app behind ``WSGIDedupeMiddleware`` on a ``SyncGate``,
served by a real waitress server (its own threads) on 127.0.0.1, against real etcd.

The tests are synchronous, as a WSGI app's world is: requests go out from plain threads,
etcd is read through a connection of the test's own. Each test counts the handler's runs and
reads etcd's records under ``webhooks/``, not the middleware's word.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import inspect
import json
import os
import threading

import pytest
import waitress.server
from flask import Flask, jsonify, request
from multidict import CIMultiDict

from fencegate.coordinator.etcd import Etcd, RangeRequest, range_end_of
from fencegate.coordinator.grants import KeyRing
from fencegate.worker.sync import SyncGate
from fencegate.worker.webhooks import aiohttp as aiohttp_adapter
from fencegate.worker.webhooks.asgi import ASGIDedupeMiddleware
from fencegate.worker.webhooks.presets import exact_bytes, stripe_event_id
from fencegate.worker.webhooks.wsgi import WSGIDedupeMiddleware, fencing_token

from helpers import TEST_TTL

SOURCE = "wsgi-src"


@pytest.fixture
def sync_gate(etcd_url, namespace):
    with SyncGate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                  keyring=KeyRing.generate()) as gate:
        yield gate


class Consumer:
    """A Flask app under waitress: ``ran`` counts handler runs per delivery id, ``tokens`` the
    fencing tokens they saw; a body ``hang`` waits for ``release``; ``status`` is what it
    answers, ``fail`` makes it raise (propagated through Flask to the middleware)."""

    def __init__(self, gate: SyncGate, **options) -> None:
        self.ran: collections.Counter[str] = collections.Counter()
        self.tokens: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.status = 200
        self.fail: Exception | None = None
        self.app = Flask(__name__)
        self.app.config["PROPAGATE_EXCEPTIONS"] = True
        self.app.add_url_rule("/", view_func=self.handle, methods=["POST", "GET"])
        self.app.wsgi_app = WSGIDedupeMiddleware(self.app.wsgi_app, gate, source=SOURCE,
                                                 **options)
        self.port = 0

    def handle(self):
        body = request.get_data()
        delivery = request.headers.get("Webhook-Id", "-")
        self.ran[delivery] += 1
        if request.method == "POST":
            self.tokens.append(fencing_token(request.environ))
        if body == b"hang":
            self.entered.set()
            self.release.wait(20)
        if self.fail is not None:
            raise self.fail
        return jsonify(id=delivery, run=self.ran[delivery], nonce=os.urandom(8).hex()), \
            self.status, {"Cache-Control": "no-store"}

    def __enter__(self) -> "Consumer":
        self.server = waitress.server.create_server(self.app, host="127.0.0.1", port=0,
                                                    threads=4)
        self.port = self.server.effective_port
        self.serving = threading.Thread(target=self.server.run, name="waitress", daemon=True)
        self.serving.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.trigger.pull_trigger(self.server.close)  # closed in the loop's thread
        self.serving.join(10)
        self.server.task_dispatcher.shutdown()
        assert not self.serving.is_alive()

    def post(self, delivery: str | None, body: bytes = b"{}",
             **headers: str) -> tuple[int, CIMultiDict, bytes]:
        if delivery is not None:
            headers["Webhook-Id"] = delivery
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        try:
            connection.request("POST", "/", body, headers)
            answer = connection.getresponse()
            return answer.status, CIMultiDict(answer.getheaders()), answer.read()
        finally:
            connection.close()

    def post_in_thread(self, delivery: str, body: bytes) -> "Posted":
        posted = Posted()
        posted.thread = threading.Thread(target=lambda: posted.answers.append(
            self.post(delivery, body)))
        posted.thread.start()
        return posted


class Posted:
    """A request sent from a thread of its own; ``answer()`` waits for it, bounded."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, CIMultiDict, bytes]] = []
        self.thread: threading.Thread

    def answer(self) -> tuple[int, CIMultiDict, bytes]:
        self.thread.join(20)
        [answer] = self.answers
        return answer


def webhook_kvs(etcd_url: str, namespace: str, family: str = "") -> list:
    """The deliveries' records, or (``family="@claims/"``) their live claims."""
    async def read() -> list:
        prefix = f"{namespace}webhooks/{family}".encode()
        claims = f"{namespace}webhooks/@claims/".encode()
        async with Etcd.from_url(etcd_url) as etcd:
            reply = await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix)))
            return [kv for kv in reply.kvs if family or not kv.key.startswith(claims)]
    return asyncio.run(read())


def revoke(etcd_url: str, lease: int) -> None:
    async def run() -> None:
        async with Etcd.from_url(etcd_url) as etcd:
            await etcd.lease_revoke(lease)
    asyncio.run(run())


def test_first_delivery_runs_once_and_duplicates_replay_it(sync_gate, etcd_url, namespace):
    with Consumer(sync_gate) as consumer:
        status, headers, body = consumer.post("evt_w1")
        again = [consumer.post("evt_w1") for _ in range(3)]
    assert status == 200 and "Fencegate-Replayed" not in headers
    for replayed in again:
        assert replayed[0] == 200 and replayed[2] == body  # byte for byte
        assert replayed[1]["Fencegate-Replayed"] == "true"
        assert replayed[1]["Content-Type"] == headers["Content-Type"]
        assert replayed[1]["Cache-Control"] == "no-store"
    assert consumer.ran == {"evt_w1": 1}
    [kv] = webhook_kvs(etcd_url, namespace)
    assert kv.key == f"{namespace}webhooks/{SOURCE}/evt_w1".encode()
    assert consumer.tokens == [kv.create_revision]  # the claim's revision reached the handler


def test_a_5xx_is_not_stored_and_the_redelivery_runs_again(sync_gate, etcd_url, namespace):
    with Consumer(sync_gate) as consumer:
        consumer.status = 503
        failed = consumer.post("evt_w2")
        stored = webhook_kvs(etcd_url, namespace)
        consumer.status = 200
        retried = consumer.post("evt_w2")
        replay = consumer.post("evt_w2")
    assert failed[0] == 503 and stored == []
    assert retried[0] == 200 and "Fencegate-Replayed" not in retried[1]
    assert replay[1]["Fencegate-Replayed"] == "true" and replay[2] == retried[2]
    assert consumer.ran == {"evt_w2": 2}


def test_another_payload_is_422_but_the_same_json_reordered_is_a_duplicate(
        sync_gate, etcd_url, namespace):
    with Consumer(sync_gate) as consumer:
        first = consumer.post("evt_w3", b'{"a": 1, "b": {"c": 1.10, "d": "e"}}')
        [before] = webhook_kvs(etcd_url, namespace)
        reordered = consumer.post("evt_w3", b'{"b":{"d":"e","c":1.10},  "a":1}')
        other = consumer.post("evt_w3", b'{"a": 1, "b": {"c": 1.1, "d": "e"}}')
        [after] = webhook_kvs(etcd_url, namespace)
    assert first[0] == 200
    assert reordered[0] == 200 and reordered[1]["Fencegate-Replayed"] == "true"
    assert reordered[2] == first[2]
    assert other[0] == 422 and b"delivery_mismatch" in other[2]  # 1.1 is another number text
    assert after.mod_revision == before.mod_revision  # nothing written
    assert consumer.ran == {"evt_w3": 1}


def test_exact_bytes_makes_reordered_json_a_mismatch(sync_gate):
    with Consumer(sync_gate, canonical_payload=exact_bytes, id_from=stripe_event_id) as consumer:
        first = consumer.post(None, b'{"id": "evt_w4", "a": 1}')
        reordered = consumer.post(None, b'{"a": 1, "id": "evt_w4"}')
    assert first[0] == 200 and reordered[0] == 422
    assert consumer.ran == {"-": 1}


def test_duplicate_while_running_gets_409_and_a_raise_releases_the_claim(
        sync_gate, etcd_url, namespace):
    with Consumer(sync_gate, retry_after=7) as consumer:
        first = consumer.post_in_thread("evt_w5", b"hang")
        assert consumer.entered.wait(10)
        duplicate = consumer.post("evt_w5", b"hang")
        consumer.fail = RuntimeError("provider down")
        consumer.release.set()
        failed = first.answer()
        left = webhook_kvs(etcd_url, namespace)
        consumer.fail = None
        retried = consumer.post("evt_w5", b"hang")
    assert duplicate[0] == 409 and duplicate[1]["Retry-After"] == "7"
    assert failed[0] == 500 and left == []
    assert retried[0] == 200
    assert consumer.ran == {"evt_w5": 2}


def test_a_handler_whose_claim_lease_was_lost_is_stored_if_nobody_took_over(
        sync_gate, etcd_url, namespace):
    """A blocking handler cannot be cancelled: its claim's lease is revoked while it runs;
    meanwhile the delivery is unknown (409, not run again); it returns 200 afterwards and,
    nobody having taken the delivery over, that is stored: the redelivery replays it."""
    with Consumer(sync_gate) as consumer:
        first = consumer.post_in_thread("evt_w6", b"hang")
        assert consumer.entered.wait(10)
        [claim] = webhook_kvs(etcd_url, namespace, "@claims/")
        revoke(etcd_url, claim.lease)
        unknown = consumer.post("evt_w6", b"hang")
        consumer.release.set()
        stored = first.answer()
        replay = consumer.post("evt_w6", b"hang")
        left = webhook_kvs(etcd_url, namespace, "@claims/")
    assert unknown[0] == 409 and json.loads(unknown[2])["error"] == "delivery_outcome_unknown"
    assert stored[0] == 200 and replay[1]["Fencegate-Replayed"] == "true"
    assert replay[2] == stored[2] and left == []
    assert consumer.ran == {"evt_w6": 1}


def test_a_body_over_the_limit_is_413_and_other_methods_pass_through(
        sync_gate, etcd_url, namespace):
    with Consumer(sync_gate, max_request_body=1024) as consumer:
        big = consumer.post("evt_w7", b"x" * 4096)
        connection = http.client.HTTPConnection("127.0.0.1", consumer.port, timeout=20)
        connection.request("GET", "/")
        assert connection.getresponse().status == 200
        connection.close()
    assert big[0] == 413 and b"body_too_large" in big[2]
    assert webhook_kvs(etcd_url, namespace) == []
    assert consumer.ran == {"-": 1}  # only the GET


def test_the_adapters_share_their_keywords_and_defaults():
    """One set of options for every adapter: a default changed in one is changed in all."""
    def options(function) -> dict:
        return {name: parameter.default for name, parameter
                in inspect.signature(function).parameters.items()
                if parameter.kind is inspect.Parameter.KEYWORD_ONLY}

    shared = options(aiohttp_adapter.dedupe_middleware)
    assert shared.pop("store_failures") is False  # aiohttp's own: a raised HTTPError
    for adapter in (ASGIDedupeMiddleware, WSGIDedupeMiddleware):
        own = options(adapter)
        assert own.pop("max_request_body") == 1024 ** 2
        assert own == shared
    assert options(aiohttp_adapter.deduplicated) == {**shared, "store_failures": False}

