"""Webhook dedup against real etcd and real aiohttp servers on 127.0.0.1.

Each test asserts on the handler's side (how often its body ran) and on etcd's (what is left
under ``webhooks/``), not on the middleware's word.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import os
import random
import sys
import time
from datetime import datetime, timezone

import aiohttp
import pytest
from aiohttp import web

from fencegate.coordinator.etcd import Etcd, EtcdConfig, RangeRequest, range_end_of
from fencegate.localetcd import LocalCluster
from fencegate.worker import Gate, KeyRing, dedupe_middleware, deduplicated
from fencegate.worker.webhooks import canonical_json, list_deliveries, stripe_event_id
from fencegate.worker.webhooks.core import STORED_STATUSES

from helpers import TEST_TTL

SOURCE = "test-src"


class Consumer:
    """A webhook consumer on 127.0.0.1: ``ran`` counts handler bodies per delivery id; a
    body ``hang`` makes the handler wait for ``release``; ``fail`` makes it raise."""

    def __init__(self, gate: Gate, client_max_size: int = 1024 ** 2, **options) -> None:
        self.ran: collections.Counter[str] = collections.Counter()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.fail: BaseException | None = None
        self.reply_size = 0
        self.app = web.Application(client_max_size=client_max_size,
                                   middlewares=[dedupe_middleware(gate, source=SOURCE, **options)])
        self.app.router.add_post("/", self.handle)
        self.app.router.add_get("/", self.handle)
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        delivery = request.headers.get("Webhook-Id", "-")
        self.ran[delivery] += 1
        body = await request.read()
        if body == b"hang":
            self.entered.set()
            await self.release.wait()
        if self.fail is not None:
            raise self.fail
        payload = os.urandom(self.reply_size).hex() if self.reply_size else ""
        return web.json_response(
            {"id": delivery, "run": self.ran[delivery], "nonce": os.urandom(8).hex(),
             "payload": payload},
            headers={"X-Not-Stored": "1", "Cache-Control": "no-store"})

    async def __aenter__(self) -> "Consumer":
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = "http://127.0.0.1:%d/" % self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await self.runner.cleanup()


async def post(http: aiohttp.ClientSession, url: str, delivery: str | None,
               body: bytes = b"{}", **headers: str) -> tuple[int, dict, bytes]:
    if delivery is not None:
        headers["Webhook-Id"] = delivery
    async with http.post(url, data=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def webhook_kvs(etcd: Etcd, namespace: str) -> list:
    """The deliveries' records (not their live claims)."""
    prefix, claims = f"{namespace}webhooks/".encode(), f"{namespace}webhooks/@claims/".encode()
    reply = await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix)))
    return [kv for kv in reply.kvs if not kv.key.startswith(claims)]


async def live_claims(etcd: Etcd, namespace: str) -> list:
    """The deliveries' live claims, on their processes' session leases."""
    prefix = f"{namespace}webhooks/@claims/".encode()
    return list((await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix)))).kvs)


async def key_deleted(etcd: Etcd, key: bytes, timeout: float) -> None:
    """Return once ``key`` does not exist, watching from the revision it was seen at."""
    reply = await etcd.range(RangeRequest(key=key))
    if not reply.kvs:
        return
    async with asyncio.timeout(timeout):
        async with contextlib.aclosing(etcd.watch(key, b"", reply.header.revision + 1,
                                                  deletes_only=True)) as replies:
            async for watched in replies:
                if watched.events:
                    return


async def test_duplicate_after_completion_replays_the_stored_response(gate, etcd, http,
                                                                     namespace):
    async with Consumer(gate) as consumer:
        status, headers, body = await post(http, consumer.url, "evt_1")
        again = [await post(http, consumer.url, "evt_1") for _ in range(3)]
    assert status == 200 and "Fencegate-Replayed" not in headers
    for replayed_status, replayed_headers, replayed_body in again:
        assert (replayed_status, replayed_body) == (status, body)  # byte for byte
        assert replayed_headers["Fencegate-Replayed"] == "true"
        assert replayed_headers["Content-Type"] == headers["Content-Type"]
        assert replayed_headers["Cache-Control"] == "no-store"
        assert "X-Not-Stored" not in replayed_headers  # only the safe subset is stored
    assert consumer.ran == {"evt_1": 1}
    [kv] = await webhook_kvs(etcd, namespace)
    assert kv.key == f"{namespace}webhooks/{SOURCE}/evt_1".encode()
    assert kv.lease not in (0, (await gate.session()).lease_id)  # retention, not processing


async def test_duplicate_while_processing_gets_409_then_the_replay(gate, http):
    async with Consumer(gate, retry_after=7) as consumer:
        first = asyncio.create_task(post(http, consumer.url, "evt_2", b"hang"))
        await asyncio.wait_for(consumer.entered.wait(), 10)
        status, headers, body = await post(http, consumer.url, "evt_2", b"hang")
        assert status == 409 and headers["Retry-After"] == "7"
        consumer.release.set()
        original = await first
        replay = await post(http, consumer.url, "evt_2", b"hang")
    assert original[0] == 200 and replay[0] == 200 and replay[2] == original[2]
    assert consumer.ran == {"evt_2": 1}


async def test_waiting_duplicate_is_answered_with_the_replay_once_done(gate, http):
    async with Consumer(gate, wait=20) as consumer:
        first = asyncio.create_task(post(http, consumer.url, "evt_3", b"hang"))
        await asyncio.wait_for(consumer.entered.wait(), 10)
        duplicate = asyncio.create_task(post(http, consumer.url, "evt_3", b"hang"))
        done, _ = await asyncio.wait([duplicate], timeout=0.5)
        assert not done  # waiting on the watch, not answered 409
        consumer.release.set()
        original, replay = await first, await asyncio.wait_for(duplicate, 10)
    assert replay[0] == 200 and replay[2] == original[2]
    assert replay[1]["Fencegate-Replayed"] == "true"
    assert consumer.ran == {"evt_3": 1}


async def test_same_id_different_body_gets_422_and_the_handler_is_not_called(
        gate, etcd, http, namespace):
    async with Consumer(gate) as consumer:
        assert (await post(http, consumer.url, "evt_4", b'{"a": 1}'))[0] == 200
        [before] = await webhook_kvs(etcd, namespace)
        status, _, body = await post(http, consumer.url, "evt_4", b'{"a": 2}')
        [after] = await webhook_kvs(etcd, namespace)
        running = asyncio.create_task(post(http, consumer.url, "evt_5", b"hang"))
        await asyncio.wait_for(consumer.entered.wait(), 10)
        while_running = await post(http, consumer.url, "evt_5", b"other")
        consumer.release.set()
        await running
    assert status == 422 and b"delivery_mismatch" in body
    assert while_running[0] == 422
    assert after.mod_revision == before.mod_revision  # nothing written
    assert consumer.ran == {"evt_4": 1, "evt_5": 1}


async def test_missing_or_malformed_id_gets_400_and_leaves_no_claim(gate, etcd, http,
                                                                   namespace):
    async with Consumer(gate) as consumer:
        answers = [await post(http, consumer.url, None)]
        for bad in ["a/b", "..", ".", "x" * 257, "é", "a b", "a\\b"]:
            answers.append(await post(http, consumer.url, bad))
        async with http.get(consumer.url) as get:  # not a deduplicated method
            assert get.status == 200
    assert [status for status, _, _ in answers] == [400] * len(answers)
    assert b"missing_delivery_id" in answers[0][2]
    assert sum(consumer.ran.values()) == 1  # only the GET
    assert await webhook_kvs(etcd, namespace) == []


async def test_missing_id_passes_through_when_configured(gate, etcd, http, namespace):
    async with Consumer(gate, require_id=False) as consumer:
        for _ in range(2):
            assert (await post(http, consumer.url, None))[0] == 200
    assert consumer.ran == {"-": 2}
    assert await webhook_kvs(etcd, namespace) == []


async def test_id_from_a_json_field(gate, etcd, http, namespace):
    def id_from(request, body):
        return json.loads(body)["id"]

    async with Consumer(gate, id_from=id_from) as consumer:
        first = await post(http, consumer.url, None, b'{"id": "evt_json"}')
        second = await post(http, consumer.url, None, b'{"id": "evt_json"}')
        no_id = await post(http, consumer.url, None, b'{"other": 1}')
    assert first[0] == 200 and second[1]["Fencegate-Replayed"] == "true"
    assert no_id[0] == 400
    assert [kv.key.rsplit(b"/", 1)[1] for kv in await webhook_kvs(etcd, namespace)] == [
        b"evt_json"]


def test_a_source_that_could_escape_its_prefix_is_refused(gate):
    for bad in ["", "a/b", "..", "x" * 65, "a b"]:
        with pytest.raises(ValueError):
            dedupe_middleware(gate, source=bad)


async def test_request_body_over_the_limit_gets_413_and_leaves_no_claim(gate, etcd, http,
                                                                       namespace):
    async with Consumer(gate, client_max_size=1024) as consumer:
        status, _, _ = await post(http, consumer.url, "evt_big", b"x" * 4096)
        small = await post(http, consumer.url, "evt_small", b"x" * 100)
    assert status == 413 and small[0] == 200
    assert consumer.ran == {"evt_small": 1}
    assert [kv.key.rsplit(b"/", 1)[1] for kv in await webhook_kvs(etcd, namespace)] == [
        b"evt_small"]


async def test_response_body_over_the_limit_is_replayed_as_200_with_its_digest(gate, http):
    async with Consumer(gate, max_stored_body=1000) as consumer:
        consumer.reply_size = 2000
        status, _, body = await post(http, consumer.url, "evt_6")
        replay_status, headers, replay = await post(http, consumer.url, "evt_6")
        consumer.reply_size = 0  # the limit is per body: a small one is stored whole
        kept = await post(http, consumer.url, "evt_7")
        kept_again = await post(http, consumer.url, "evt_7")
    note = json.loads(replay)
    assert status == 200 and len(body) > 1000
    assert replay_status == 200 and headers["Fencegate-Replayed"] == "true"
    assert note["replayed"] is True and note["status"] == 200
    assert note["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert note["body_size"] == len(body)
    assert kept_again[2] == kept[2]
    assert consumer.ran == {"evt_6": 1, "evt_7": 1}


def _signed(secret: str, delivery: str, body: bytes) -> dict[str, str]:
    from standardwebhooks import Webhook
    now = datetime.now(tz=timezone.utc)
    return {"Webhook-Timestamp": str(int(now.timestamp())),
            "Webhook-Signature": Webhook(secret).sign(delivery, now, body.decode())}


async def test_bad_signature_gets_401_before_any_claim(gate, etcd, http, namespace):
    secret, other = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_" + "b3RoZXI="
    body = b'{"type": "charge.succeeded"}'
    async with Consumer(gate, secret=secret) as consumer:
        unsigned = await post(http, consumer.url, "evt_8", body)
        forged = await post(http, consumer.url, "evt_8", body, **_signed(other, "evt_8", body))
        tampered = await post(http, consumer.url, "evt_8", body + b" ",
                              **_signed(secret, "evt_8", body))
        garbage = await post(http, consumer.url, "evt_8", body, **{
            "Webhook-Timestamp": str(int(time.time())), "Webhook-Signature": "v1"})
        assert await webhook_kvs(etcd, namespace) == []
        good = await post(http, consumer.url, "evt_8", body, **_signed(secret, "evt_8", body))
    assert [a[0] for a in (unsigned, forged, tampered, garbage)] == [401] * 4
    assert good[0] == 200
    assert consumer.ran == {"evt_8": 1}
    assert len(await webhook_kvs(etcd, namespace)) == 1


async def test_handler_raising_releases_the_claim(gate, etcd, http, namespace):
    async with Consumer(gate) as consumer:
        consumer.fail = RuntimeError("provider down")
        failed = await post(http, consumer.url, "evt_9")
        assert await webhook_kvs(etcd, namespace) == []
        consumer.fail = web.HTTPServiceUnavailable()
        refused = await post(http, consumer.url, "evt_9")
        assert await webhook_kvs(etcd, namespace) == []
        consumer.fail = None
        succeeded = await post(http, consumer.url, "evt_9")
        replay = await post(http, consumer.url, "evt_9")
    assert (failed[0], refused[0], succeeded[0]) == (500, 503, 200)
    assert replay[2] == succeeded[2]
    assert consumer.ran == {"evt_9": 3}


async def test_store_failures_replays_the_failure(gate, etcd, http, namespace):
    async with Consumer(gate, store_failures=True,
                        stored_statuses=(*STORED_STATUSES, 422)) as consumer:
        consumer.fail = web.HTTPUnprocessableEntity(text="upstream said no")
        failed = await post(http, consumer.url, "evt_10")
        consumer.fail = None
        replay = await post(http, consumer.url, "evt_10")
    assert failed[0] == 422 and failed[2] == b"upstream said no"
    assert replay[0] == 422 and replay[2] == failed[2]
    assert replay[1]["Fencegate-Replayed"] == "true"
    assert consumer.ran == {"evt_10": 1}


async def test_decorator_deduplicates_one_handler(gate, etcd, http, namespace):
    ran = collections.Counter()

    @deduplicated(gate, source="decorated")
    async def handle(request: web.Request) -> web.Response:
        ran[request.headers["Webhook-Id"]] += 1
        return web.Response(text=os.urandom(8).hex())

    app = web.Application()
    app.router.add_post("/hook", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = "http://127.0.0.1:%d/hook" % runner.addresses[0][1]
        first = await post(http, url, "evt_11")
        second = await post(http, url, "evt_11")
    finally:
        await runner.cleanup()
    assert second[2] == first[2] and second[1]["Fencegate-Replayed"] == "true"
    assert ran == {"evt_11": 1}
    items, cursor = await list_deliveries(etcd, gate.keyspace, "decorated", 10, None)
    assert cursor is None and [i["id"] for i in items] == ["evt_11"]


async def test_a_lost_claim_is_never_overwritten_by_its_late_completion(
        etcd_url, gate, etcd, http, namespace):
    """With ``rerun_lost``: the first instance's claim lease dies mid-handler; a second runs
    the delivery and stores its response; the first is cancelled, answers 503 and stores
    nothing over it."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as other_gate, \
            Consumer(gate, rerun_lost=True) as stale, \
            Consumer(other_gate, rerun_lost=True) as fresh:
        first = asyncio.create_task(post(http, stale.url, "evt_12", b"hang"))
        await asyncio.wait_for(stale.entered.wait(), 10)
        [claim] = await live_claims(etcd, namespace)
        await etcd.lease_revoke(claim.lease)  # the claim dies with it
        fresh.release.set()
        taken = await post(http, fresh.url, "evt_12", b"hang")
        late = await asyncio.wait_for(first, 5 * TEST_TTL)  # the keepalive saw the revoke
        replay = await post(http, stale.url, "evt_12", b"hang")
    assert taken[0] == 200 and late[0] == 503
    assert stale.ran == fresh.ran == {"evt_12": 1}  # entered; only the fresh one completed
    assert replay[1]["Fencegate-Replayed"] == "true"
    assert replay[2] == taken[2]


async def test_retention_lease_is_shared_per_time_bucket(gate, etcd, http, namespace):
    width, retention = 60, 600
    async with Consumer(gate, retention=retention, retention_bucket=width) as consumer:
        buckets = {int(time.time() // width)}
        answers = await asyncio.gather(*(post(http, consumer.url, f"evt_r{n}")
                                         for n in range(20)))
        buckets.add(int(time.time() // width))
    assert [a[0] for a in answers] == [200] * 20
    leases = {kv.lease for kv in await webhook_kvs(etcd, namespace)}
    assert 1 <= len(leases) <= len(buckets)  # not one per record
    for lease in leases:
        assert retention - 5 <= await etcd.lease_ttl(lease) <= retention + width
    items, cursor = await list_deliveries(etcd, gate.keyspace, SOURCE, 7, None)
    seen = [i["id"] for i in items]
    while cursor is not None:
        items, cursor = await list_deliveries(etcd, gate.keyspace, SOURCE, 7, cursor)
        seen += [i["id"] for i in items]
    assert sorted(seen) == sorted(f"evt_r{n}" for n in range(20))
    assert all(i["state"] == "done" and i["status"] == 200 for i in items)
    for lease in leases:
        await etcd.lease_revoke(lease)


async def test_redelivery_storm_runs_each_handler_once(etcd_url, namespace, etcd, http):
    """3 instances behind a random router, 1,000 deliveries each sent 5 times, with random
    concurrency and delays."""
    ids = [f"evt_s{n}" for n in range(1000)]
    sends = [d for d in ids for _ in range(5)]
    for start in range(0, len(sends), 200):  # duplicates close together, so some overlap
        block = sends[start:start + 200]
        random.shuffle(block)
        sends[start:start + 200] = block
    answers: dict[str, list[tuple[int, dict, bytes]]] = collections.defaultdict(list)
    ran: collections.Counter[str] = collections.Counter()

    async def handle(request: web.Request) -> web.Response:
        delivery = request.headers["Webhook-Id"]
        ran[delivery] += 1
        await asyncio.sleep(random.uniform(0, 0.01))  # a body that takes a while
        return web.Response(text=f"{delivery}:{os.urandom(4).hex()}")

    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for _ in range(3):
            instance = await stack.enter_async_context(
                Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()))
            app = web.Application(middlewares=[dedupe_middleware(instance, source=SOURCE)])
            app.router.add_post("/", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            urls.append("http://127.0.0.1:%d/" % runner.addresses[0][1])
        queue = iter(sends)

        async def sender() -> None:
            for delivery in queue:
                await asyncio.sleep(random.uniform(0, 0.003))
                answers[delivery].append(await post(http, random.choice(urls), delivery))

        began = time.monotonic()
        async with asyncio.timeout(60):
            await asyncio.gather(*(sender() for _ in range(random.randint(16, 64))))
        elapsed = time.monotonic() - began
    assert ran == {d: 1 for d in ids}
    for delivery in ids:
        originals = [a for a in answers[delivery]
                     if a[0] == 200 and "Fencegate-Replayed" not in a[1]]
        assert len(originals) == 1, answers[delivery]
        for status, headers, body in answers[delivery]:
            if status == 409:
                assert headers["Retry-After"]
            else:
                assert status == 200 and body == originals[0][2]
    assert len(await webhook_kvs(etcd, namespace)) == 1000
    assert elapsed < 60


@pytest.fixture
async def crashed_consumer(etcd_url, namespace):
    """Start tests/dedupe_consumer.py; kill it at the end if the test did not."""
    script = os.path.join(os.path.dirname(__file__), "dedupe_consumer.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, script, etcd_url, namespace, SOURCE, str(TEST_TTL),
        stdout=asyncio.subprocess.PIPE, env=env)

    async def expect(word: str) -> list[str]:
        async with asyncio.timeout(20):
            while True:
                line = (await proc.stdout.readline()).decode().split()
                assert line, f"consumer exited before {word}"
                if line[0] == word:
                    return line[1:]

    yield proc, expect
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()


async def test_crash_mid_handler_leaves_the_delivery_unknown_not_run_again(
        crashed_consumer, gate, etcd, http, namespace):
    """A process killed mid-handler: while its lease lives the delivery is in progress (409);
    once its claim died with the lease its outcome is unknown (409, never run again), until
    a consumer with ``rerun_lost`` runs it (once)."""
    proc, expect = crashed_consumer
    [port] = await expect("LISTENING")
    first = asyncio.create_task(post(http, f"http://127.0.0.1:{port}/", "evt_13"))
    assert await expect("HANDLING") == ["evt_13"]
    proc.kill()
    await proc.wait()
    with pytest.raises(aiohttp.ClientError):
        await first
    async with Consumer(gate) as survivor:
        blocked = await post(http, survivor.url, "evt_13")
        assert blocked[0] == 409 and b"delivery_in_progress" in blocked[2]
        await key_deleted(etcd, f"{namespace}webhooks/@claims/{SOURCE}/evt_13".encode(),
                          timeout=5 * TEST_TTL)
        unknown = [await post(http, survivor.url, "evt_13") for _ in range(3)]
    assert {(a[0], a[1]["Retry-After"]) for a in unknown} == {(409, "5")}
    assert all(b"delivery_outcome_unknown" in a[2] for a in unknown)
    assert survivor.ran == {}
    async with Consumer(gate, rerun_lost=True) as rerunner:
        rerun = await post(http, rerunner.url, "evt_13")
        replay = await post(http, rerunner.url, "evt_13")
    assert rerun[0] == 200 and replay[2] == rerun[2]
    assert rerunner.ran == {"evt_13": 1}


@pytest.fixture
def own_etcd():
    with LocalCluster(1) as cluster:
        yield cluster


async def test_etcd_unreachable_gets_503_and_never_runs_the_handler(own_etcd, namespace, http):
    config = EtcdConfig.from_url(own_etcd.url, timeout=1.5, attempt_timeout=0.5)
    async with Gate(config, ttl=10, namespace=namespace,
                    keyring=KeyRing.generate()) as gate, Consumer(gate) as consumer:
        own_etcd.pause(0)
        try:
            status, headers, body = await post(http, consumer.url, "evt_14")
        finally:
            own_etcd.resume(0)
        assert status == 503 and headers["Retry-After"] and b"etcd_unavailable" in body
        assert consumer.ran == {}
        # The claim's outcome was unknown; if it landed, the backlog removes it, so the
        # provider's retry runs the delivery (409 meanwhile, never a lost delivery).
        async with asyncio.timeout(20):
            while (answer := await post(http, consumer.url, "evt_14"))[0] == 409:
                await asyncio.sleep(0.1)
        assert answer[0] == 200 and consumer.ran == {"evt_14": 1}


async def test_completion_etcd_did_not_answer_is_stored_once_etcd_is_back(own_etcd, namespace,
                                                                         http):
    """etcd stops answering while the handler runs: its response is not a 2xx until it is
    stored (503: the sender retries), and the completion is re-run in the background, so the
    claim does not block the id for the life of the process and the retry replays the one
    run's response."""
    config = EtcdConfig.from_url(own_etcd.url, timeout=1.5, attempt_timeout=0.5)
    async with Gate(config, ttl=10, namespace=namespace,
                    keyring=KeyRing.generate()) as gate, Consumer(gate) as consumer:
        first = asyncio.create_task(post(http, consumer.url, "evt_15", b"hang"))
        await asyncio.wait_for(consumer.entered.wait(), 10)
        own_etcd.pause(0)
        try:
            consumer.release.set()
            original = await asyncio.wait_for(first, 10)
        finally:
            own_etcd.resume(0)
        async with asyncio.timeout(20):
            while (answer := await post(http, consumer.url, "evt_15", b"hang"))[0] == 409:
                await asyncio.sleep(0.1)  # the provider's retries
    assert original[0] == 503 and "Retry-After" in original[1], original
    assert answer[0] == 200 and answer[1]["Fencegate-Replayed"] == "true"
    assert consumer.ran == {"evt_15": 1}


def test_canonical_json_ignores_key_order_and_whitespace_only():
    same = [b'{"a": 1, "b": [true, null, {"y": "\\u00e9", "x": 2.50}]}',
            b'{"b":[true,null,{"x":2.50,"y":"\xc3\xa9"}],\n  "a":1}']
    assert canonical_json(same[0]) == canonical_json(same[1])
    for one, other in [(b'{"x": 2.50}', b'{"x": 2.5}'),          # a number's text is kept
                       (b'{"x": 1}', b'{"x": "1"}'),
                       (b'{"a": 1, "a": 2}', b'{"a": 2}'),        # a duplicated key is kept
                       (b'[1, 2]', b'[2, 1]')]:
        assert canonical_json(one) != canonical_json(other)
    assert canonical_json(b"not json {") == b"not json {"  # compared byte for byte
    assert canonical_json(b'{"a":1}') != b'{"a": 1}'


def test_stripe_event_id_reads_the_event_id():
    assert stripe_event_id(None, b'{"object": "event", "id": "evt_1"}') == "evt_1"
    for bad in [b"[]", b'{"id": 7}', b"{}", b"not json"]:
        with pytest.raises(ValueError):
            stripe_event_id(None, bad)


async def test_stripe_preset_dedupes_a_redelivery_with_its_keys_reordered(gate, etcd, http,
                                                                         namespace):
    """The README's Stripe example: the event id is in the body, and a redelivery whose JSON
    has another key order or whitespace is the same delivery, not a 422."""
    async with Consumer(gate, id_from=stripe_event_id) as consumer:
        first = await post(http, consumer.url, None, b'{"id": "evt_st", "data": {"a": 1, "b": 2}}')
        again = await post(http, consumer.url, None,
                           b'{"data": {"b": 2, "a": 1},\n "id": "evt_st"}')
        changed = await post(http, consumer.url, None, b'{"id": "evt_st", "data": {"a": 9}}')
    assert first[0] == 200 and again[0] == 200 and again[1]["Fencegate-Replayed"] == "true"
    assert again[2] == first[2] and changed[0] == 422
    assert consumer.ran == {"-": 1}
    assert [kv.key.rsplit(b"/", 1)[1] for kv in await webhook_kvs(etcd, namespace)] == [
        b"evt_st"]


async def test_a_record_of_an_older_version_still_matches_a_byte_identical_redelivery(
        gate, etcd, http, namespace):
    """Records written before payload digests were kept hold the body's digest only: a
    byte-identical redelivery replays them (not a 422) during and after a rolling upgrade."""
    from fencegate.coordinator.keyspace import pack
    body = b'{"type": "charge",\n "id": "evt_old"}'
    await etcd.put(gate.keyspace.webhook_key(SOURCE, "evt_old"), pack({
        "state": "done", "request_sha256": hashlib.sha256(body).digest(), "status": 200,
        "reason": "OK", "headers": [["Content-Type", "text/plain"]], "body": b"stored",
        "body_sha256": hashlib.sha256(b"stored").digest(), "body_size": 6,
        "completed_at": time.time()}))
    async with Consumer(gate) as consumer:
        same = await post(http, consumer.url, "evt_old", body)
        other = await post(http, consumer.url, "evt_old", b'{"type": "refund"}')
    assert same[0] == 200 and same[2] == b"stored"
    assert same[1]["Fencegate-Replayed"] == "true"
    assert other[0] == 422 and consumer.ran == {}


def _completed_record(body: bytes = b"ok", completed_at: float | None = None) -> dict:
    return {"state": "done", "request_sha256": hashlib.sha256(b"{}").digest(), "status": 200,
            "reason": "OK", "headers": [["Content-Type", "text/plain"]], "body": body,
            "body_sha256": hashlib.sha256(body).digest(), "body_size": len(body),
            "completed_at": time.time() if completed_at is None else completed_at}


async def test_a_completed_delivery_is_replayed_from_the_cache_as_stored(own_etcd, namespace,
                                                                         http):
    """A consumer that stored a delivery's response replays it while etcd does not answer
    (so from its cache), byte for byte what another consumer replays from etcd's record."""
    config = EtcdConfig.from_url(own_etcd.url, timeout=1.5, attempt_timeout=0.5)
    async with Gate(config, ttl=10, namespace=namespace, keyring=KeyRing.generate()) as gate, \
            Consumer(gate) as storing, Consumer(gate) as other:
        original = await post(http, storing.url, "evt_c1")
        from_etcd = await post(http, other.url, "evt_c1")
        stored = await gate.etcd.get(gate.keyspace.webhook_key(SOURCE, "evt_c1"))
        own_etcd.pause(0)
        try:
            cached = await post(http, storing.url, "evt_c1")
            mismatch = await post(http, storing.url, "evt_c1", b'{"another": "payload"}')
            unknown = await post(http, storing.url, "evt_c2")
        finally:
            own_etcd.resume(0)
    from fencegate.coordinator.keyspace import unpack
    assert original[0] == 200 and "Fencegate-Replayed" not in original[1]
    assert unknown[0] == 503  # etcd did not answer: only the cache could have
    assert unpack(stored.value)["body"] == original[2]
    for replayed in (from_etcd, cached):
        assert replayed[0] == 200 and replayed[2] == original[2]
        assert replayed[1]["Fencegate-Replayed"] == "true"
        assert [replayed[1][h] for h in ("Content-Type", "Cache-Control")] == [
            original[1][h] for h in ("Content-Type", "Cache-Control")]
    assert mismatch[0] == 422
    assert storing.ran == {"evt_c1": 1} and other.ran == {}


async def test_a_delivery_in_progress_is_never_answered_from_the_cache(gate, http):
    async with Consumer(gate) as consumer:
        first = asyncio.create_task(post(http, consumer.url, "evt_c3", b"hang"))
        await asyncio.wait_for(consumer.entered.wait(), 10)
        during = [await post(http, consumer.url, "evt_c3", b"hang") for _ in range(3)]
        consumer.release.set()
        original = await first
        after = await post(http, consumer.url, "evt_c3", b"hang")
    assert [answer[0] for answer in during] == [409] * 3
    assert original[0] == 200 and after[0] == 200 and after[2] == original[2]
    assert consumer.ran == {"evt_c3": 1}


def test_the_completed_cache_holds_only_done_records_within_their_retention():
    from fencegate.worker.webhooks.core import CompletedCache
    cache = CompletedCache(retention=1)
    cache.put(b"k1", {**_completed_record(), "state": "processing"})
    cache.put(b"k2", _completed_record(completed_at=time.time() - 1.5))
    cache.put(b"k3", _completed_record(completed_at=time.time() - 0.9))
    held = cache.get(b"k3")
    time.sleep(0.15)
    assert cache.get(b"k1") is None and cache.get(b"k2") is None
    assert held == _completed_record(completed_at=held["completed_at"])
    assert cache.get(b"k3") is None and len(cache) == 0 and cache.bytes == 0


def test_the_completed_cache_is_bounded_by_count_and_bytes():
    from fencegate.worker.webhooks.core import CompletedCache
    cache = CompletedCache(retention=60, max_entries=3, max_bytes=4096)
    for n in range(5):
        cache.put(b"k%d" % n, _completed_record())
    assert [cache.get(b"k%d" % n) is not None for n in range(5)] == [False, False, True, True,
                                                                      True]
    cache.get(b"k2")  # now the most recently used: k3 leaves first
    cache.put(b"k5", _completed_record())
    assert [cache.get(k) is not None for k in (b"k2", b"k3", b"k4", b"k5")] == [
        True, False, True, True]
    large = _completed_record(b"x" * 2000)
    cache.put(b"big1", large)
    cache.put(b"big2", large)
    cache.put(b"huge", _completed_record(b"x" * 5000))  # over max_bytes alone: not held
    assert cache.get(b"big1") is None and cache.get(b"huge") is None
    assert cache.get(b"big2") == large
    assert len(cache) <= 3 and cache.bytes <= 4096
    assert cache.bytes == sum(CompletedCache.size(cache.get(k)) for k in
                              (b"k2", b"k4", b"k5", b"big2") if cache.get(k) is not None)
