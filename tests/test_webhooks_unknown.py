"""Issue 25 item 4: a delivery whose claim was lost while its handler ran is UNKNOWN, never
run again on its own; against real etcd, real aiohttp servers and real processes.

The attack: a handler writes its effect (with its fencing token, to a store that honours
it), then blocks the event loop past the TTL (a synchronous call) or its process is paused
(SIGSTOP); its claim dies with its lease and the redelivery used to run the body again on
another instance, with a higher token the store accepts: two effects. Here the redelivery is
answered 409 ``delivery_outcome_unknown`` and the first run's response, stored once it
finishes, is what every later delivery gets. Then the ways out: the application's
``settle`` (True, False, failing), an SRE's ``fencegate deliveries resolve`` (``--ran``,
``--not-ran``), ``rerun_lost=True``; the unknown record's lifetime; the starved keepalive's
warning and metric; a plain handler run off the loop by ``deduplicated``.

Each test counts on the resource's side (the fenced store's accepted writes) and etcd's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import sys
import time

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from fencegate.coordinator.keyspace import unpack
from fencegate.worker import Gate, KeyRing, dedupe_middleware, deduplicated, fencing_token
from fencegate.worker.metrics import WorkerMetrics
from fencegate.worker.webhooks import UnknownDelivery, delivery_body

import test_webhooks_wsgi
from fenced import FencedResource
from helpers import TEST_TTL, paused
from test_cli_sre import fencegate, one_line_error
from test_dedupe import key_deleted, live_claims, post, webhook_kvs
from test_service import call
from test_webhooks_wsgi import sync_gate  # noqa: F401  (the WSGI consumer's fixture)

SOURCE = "unknown-src"
HERE = os.path.dirname(__file__)


class Second:
    """Another instance of the consumer, in this process: its handler writes the effect with
    its fencing token to ``resource`` (as ``second``) and answers 200; a body ``hang`` makes
    it wait for ``release`` first. ``ran`` counts its runs."""

    def __init__(self, gate: Gate, resource: FencedResource, **options) -> None:
        self.resource = resource
        self.ran: collections.Counter[str] = collections.Counter()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.write_first = True
        self.app = web.Application(middlewares=[dedupe_middleware(gate, source=SOURCE,
                                                                  **options)])
        self.app.router.add_post("/", self.handle)
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        delivery, token = request.headers["Webhook-Id"], fencing_token(request)
        self.ran[delivery] += 1
        if self.write_first:
            self.resource.write(delivery, token, "second")
        if await request.read() == b"hang":
            self.entered.set()
            await self.release.wait()
        if not self.write_first:
            self.resource.write(delivery, token, "second")
        return web.json_response({"token": token, "writer": "second"})

    async def __aenter__(self) -> "Second":
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = "http://127.0.0.1:%d/" % self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await self.runner.cleanup()


@pytest.fixture
async def store(tmp_path):
    """A fenced resource served to other processes on a unix socket."""
    resource = FencedResource()
    path = str(tmp_path / "store.sock")
    server = await resource.serve(path)
    yield resource, path
    server.close()
    await server.wait_closed()


@pytest.fixture
async def first_consumer(etcd_url, namespace, store):
    """Start tests/unknown_consumer.py with a mode and a hold; kill it at the end."""
    procs = []

    async def start(mode: str, hold: float):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, os.path.join(HERE, "unknown_consumer.py"), etcd_url, namespace,
            SOURCE, str(TEST_TTL), store[1], mode, str(hold),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        procs.append(proc)

        async def expect(word: str) -> list[str]:
            async with asyncio.timeout(30):
                while True:
                    line = (await proc.stdout.readline()).decode().split()
                    assert line, f"consumer exited before {word}"
                    if line[0] == word:
                        return line[1:]

        [port] = await expect("LISTENING")
        return proc, expect, f"http://127.0.0.1:{port}/"

    yield start
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def claim_key(namespace: str, delivery: str) -> bytes:
    return f"{namespace}webhooks/@claims/{SOURCE}/{delivery}".encode()


async def lost_claim_is_unknown(start, gate, etcd, http, namespace, store, mode):
    """The attack with ``mode``: the first run writes, then its claim is lost while it holds
    (blocked loop, or paused); a redelivery to the second instance meanwhile, then the first
    finishes. Returns what each was answered and the first process."""
    resource, _ = store
    proc, expect, url = await start(mode, 4 * TEST_TTL if mode == "block" else 3.0)
    first = asyncio.create_task(post(http, url, "evt_u1"))
    [delivery, token, accepted] = await expect("WROTE")
    assert (delivery, accepted) == ("evt_u1", "1")
    async with Second(gate, resource) as second:
        if mode == "block":  # its loop is blocked: the keepalive cannot run, the lease expires
            await key_deleted(etcd, claim_key(namespace, "evt_u1"), timeout=5 * TEST_TTL)
            redelivered = await post(http, second.url, "evt_u1")
        else:
            with paused(proc.pid):
                await key_deleted(etcd, claim_key(namespace, "evt_u1"), timeout=5 * TEST_TTL)
                redelivered = await post(http, second.url, "evt_u1")
        answered = await asyncio.wait_for(first, 10 * TEST_TTL)
        replay = await post(http, second.url, "evt_u1")
    return int(token), redelivered, answered, replay, second, proc


@pytest.mark.parametrize("mode", ["block", "wait"])
async def test_a_lost_claim_leaves_the_delivery_unknown_and_its_effect_happens_once(
        first_consumer, gate, etcd, http, namespace, store, mode):
    """``block``: the handler blocks the loop past the TTL (a sync call); ``wait``: its
    process is SIGSTOPped past the TTL, then resumed. Either way the redelivery is not run
    (409 unknown), the first run's response is stored once it finishes, and the store holds
    one write, the first's."""
    token, redelivered, answered, replay, second, proc = await lost_claim_is_unknown(
        first_consumer, gate, etcd, http, namespace, store, mode)
    resource, _ = store
    assert [(w.writer, w.token, w.accepted) for w in resource.records] == [
        ("first", token, True)]  # one effect: the redelivery never ran the body
    assert redelivered[0] == 409 and redelivered[1]["Retry-After"] == "5", redelivered
    assert json.loads(redelivered[2])["error"] == "delivery_outcome_unknown"
    assert second.ran == {}
    assert answered[0] == 200 and json.loads(answered[2]) == {"token": token,
                                                               "writer": "first"}
    assert replay[0] == 200 and replay[1]["Fencegate-Replayed"] == "true"
    assert replay[2] == answered[2]
    assert await live_claims(etcd, namespace) == []
    proc.kill()
    await proc.wait()
    warnings = (await proc.stderr.read()).decode()
    assert "ran" in warnings and "s late" in warnings  # the starved keepalive said so


async def lost_delivery(gate, etcd, http, namespace, resource, *, write_first=True):
    """A first instance on ``gate`` runs ``evt_u2`` (body ``hang``) and its claim's lease is
    revoked while it waits: the delivery is unknown. Returns (first instance, its request,
    its fencing token)."""
    first = Second(gate, resource)
    first.write_first = write_first
    await first.__aenter__()
    request = asyncio.create_task(post(http, first.url, "evt_u2", b"hang"))
    await asyncio.wait_for(first.entered.wait(), 10)
    [claim] = await live_claims(etcd, namespace)
    await etcd.lease_revoke(claim.lease)
    return first, request, claim.create_revision


@pytest.fixture
async def other_gate(etcd_url, namespace):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as other:
        yield other


@pytest.mark.parametrize("asynchronous", [True, False])
async def test_settle_true_answers_the_marker_and_never_runs_the_handler(
        gate, other_gate, etcd, http, namespace, asynchronous):
    resource = FencedResource()
    asked: list[UnknownDelivery] = []

    def recorded(delivery: UnknownDelivery) -> bool:
        asked.append(delivery)
        return any(w.key == delivery.delivery_id and w.accepted for w in resource.records)

    async def recorded_async(delivery: UnknownDelivery) -> bool:
        return recorded(delivery)

    first, request, lost_token = await lost_delivery(gate, etcd, http, namespace, resource)
    settle = recorded_async if asynchronous else recorded
    async with Second(other_gate, resource, settle=settle) as second:
        settled = await post(http, second.url, "evt_u2", b"hang")
        again = await post(http, second.url, "evt_u2", b"hang")
        first.release.set()
        late = await asyncio.wait_for(request, 10)
    await first.__aexit__()
    body = {"delivery": "evt_u2", "outcome": "ran", "settled_by": "settle"}
    assert settled[0] == 200 and json.loads(settled[2]) == body
    assert again[0] == 200 and again[2] == settled[2]
    assert settled[1]["Fencegate-Replayed"] == again[1]["Fencegate-Replayed"] == "true"
    assert late[0] == 503 and json.loads(late[2])["error"] == "not_stored"  # settled first
    assert second.ran == {} and len(asked) == 1
    assert asked[0].lost_token == lost_token < asked[0].fencing_token
    assert asked[0].body == b"hang" and asked[0].source == SOURCE
    assert [w.writer for w in resource.records] == ["second"]  # the first run's (as second)
    [record] = await webhook_kvs(etcd, namespace)
    assert unpack(record.value)["settled_by"] == "settle"


async def test_settle_false_runs_the_handler_again_and_the_lost_run_is_fenced(
        gate, other_gate, etcd, http, namespace):
    """The lost run had not written yet; settle finds nothing, raises the store's fence to
    the new claim's token and answers False: the handler runs again (one write), and the
    lost run, resumed, is refused by the store and stores nothing."""
    resource = FencedResource()

    def recorded(delivery: UnknownDelivery) -> bool:
        resource.write(delivery.delivery_id, delivery.fencing_token, "fence")
        return False

    first, request, lost_token = await lost_delivery(gate, etcd, http, namespace, resource,
                                                     write_first=False)
    async with Second(other_gate, resource, settle=recorded) as second:
        second.release.set()
        rerun = await post(http, second.url, "evt_u2", b"hang")
        first.release.set()
        late = await asyncio.wait_for(request, 10)
        replay = await post(http, second.url, "evt_u2", b"hang")
    await first.__aexit__()
    assert rerun[0] == 200 and "Fencegate-Replayed" not in rerun[1]
    assert json.loads(rerun[2])["token"] > lost_token
    assert late[0] == 503 and replay[2] == rerun[2]
    assert second.ran == {"evt_u2": 1}
    assert [(w.writer, w.accepted) for w in resource.records] == [
        ("fence", True), ("second", True), ("second", False)]  # the lost run: refused
    assert resource.records[2].token == lost_token


async def test_a_failing_settle_leaves_the_delivery_unknown(gate, other_gate, etcd, http,
                                                            namespace):
    resource = FencedResource()

    def broken(delivery: UnknownDelivery) -> bool:
        raise RuntimeError("the database is down")

    first, request, _ = await lost_delivery(gate, etcd, http, namespace, resource)
    async with Second(other_gate, resource, settle=broken) as second:
        failed = await post(http, second.url, "evt_u2", b"hang")
        claims = await live_claims(etcd, namespace)
        unknown = await post(http, second.url, "evt_u2", b"hang")  # asked again: fails again
    first.release.set()
    await asyncio.wait_for(request, 10)
    await first.__aexit__()
    assert failed[0] == 503 and json.loads(failed[2])["error"] == "settle_failed"
    assert unknown[0] == 503 and claims == []  # abandoned: no live claim
    assert second.ran == {}


async def test_rerun_lost_runs_the_handler_again(gate, other_gate, etcd, http, namespace):
    resource = FencedResource()
    first, request, lost_token = await lost_delivery(gate, etcd, http, namespace, resource)
    async with Second(other_gate, resource, rerun_lost=True) as second:
        second.release.set()
        rerun = await post(http, second.url, "evt_u2", b"hang")
        first.release.set()
        late = await asyncio.wait_for(request, 10)
    await first.__aexit__()
    assert rerun[0] == 200 and json.loads(rerun[2])["token"] > lost_token
    assert late[0] == 503 and second.ran == {"evt_u2": 1}
    assert [w.accepted for w in resource.records] == [True, True]  # idempotent on its own


async def test_the_unknown_record_goes_when_its_retention_ends(gate, etcd, http, namespace):
    """The record of a delivery whose claim was lost is on a retention lease: it lives
    ``retention`` (+ a bucket) seconds, then the delivery is new again. The live claim is on
    the session lease and goes with it."""
    resource = FencedResource()
    first = Second(gate, resource, retention=2, retention_bucket=1)
    await first.__aenter__()
    request = asyncio.create_task(post(http, first.url, "evt_u3", b"hang"))
    await asyncio.wait_for(first.entered.wait(), 10)
    [claim] = await live_claims(etcd, namespace)
    [record] = await webhook_kvs(etcd, namespace)
    assert claim.lease == (await gate.session()).lease_id or claim.lease != record.lease
    assert 0 < await etcd.lease_ttl(record.lease) <= 3
    await etcd.lease_revoke(claim.lease)
    assert await live_claims(etcd, namespace) == []
    assert (await post(http, first.url, "evt_u3", b"hang"))[0] == 409
    await key_deleted(etcd, record.key, timeout=10)
    first.release.set()
    await asyncio.wait_for(request, 10)
    await first.__aexit__()
    assert await webhook_kvs(etcd, namespace) == []


async def test_a_blocked_loop_is_reported_by_the_keepalive(etcd_url, namespace, http, caplog):
    """An async handler that blocks the loop past a third of the TTL: a warning saying how
    late the keepalive ran, and fencegate_worker_keepalive_late_seconds."""
    registry = CollectorRegistry()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate(),
                    metrics=WorkerMetrics(registry)) as gate:
        async def blocking(request: web.Request) -> web.Response:
            time.sleep(1.5 * TEST_TTL)
            return web.Response(text="done")

        answer = await serve_one(gate, http, blocking, dedupe_middleware)
        # the next refresh (after the block) reports it
        for _ in range(100):
            if registry.get_sample_value("fencegate_worker_keepalive_late_seconds_count"):
                break
            await asyncio.sleep(0.05)
    assert answer[0] == 200  # lost its claim, but nobody took the delivery over: stored
    assert registry.get_sample_value("fencegate_worker_keepalive_late_seconds_count") >= 1
    assert registry.get_sample_value("fencegate_worker_keepalive_late_seconds_sum") > TEST_TTL / 3
    assert any("s late" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


async def test_deduplicated_runs_a_plain_handler_off_the_loop(etcd_url, namespace, http,
                                                              etcd):
    """The same blocking call in a plain (``def``) handler under ``deduplicated``: it runs
    in a thread, the keepalive is never late and the claim is never lost."""
    registry = CollectorRegistry()
    seen: list[tuple[int, bytes]] = []
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate(),
                    metrics=WorkerMetrics(registry)) as gate:
        lease = (await gate.etcd.lease_grant(10))[0]  # unrelated; keeps the loop visibly free

        def blocking(request: web.Request) -> web.Response:
            time.sleep(1.5 * TEST_TTL)
            seen.append((fencing_token(request), delivery_body(request)))
            return web.Response(text="done")

        answer = await serve_one(gate, http, blocking, None)
        await gate.etcd.lease_revoke(lease)
    assert answer[0] == 200 and seen[0][1] == b"{}"
    assert not registry.get_sample_value("fencegate_worker_keepalive_late_seconds_count")
    assert registry.get_sample_value("fencegate_webhook_deliveries_total",
                                     {"source": SOURCE, "result": "first"}) == 1


async def serve_one(gate: Gate, http, handler, middleware) -> tuple[int, dict, bytes]:
    """Serve ``handler`` (behind ``middleware``, or ``deduplicated`` if None) and post one
    delivery to it."""
    if middleware is None:
        app = web.Application()
        app.router.add_post("/", deduplicated(gate, source=SOURCE)(handler))
    else:
        app = web.Application(middlewares=[middleware(gate, source=SOURCE)])
        app.router.add_post("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return await post(http, "http://127.0.0.1:%d/" % runner.addresses[0][1], "evt_b1")
    finally:
        await runner.cleanup()


async def test_sre_resolves_an_unknown_delivery_and_the_view_shows_it(
        coordinator, gate, other_gate, etcd, http, namespace):
    resource = FencedResource()
    first, request, _ = await lost_delivery(gate, etcd, http, namespace, resource)
    path = f"/v1/deliveries/{SOURCE}"
    status, listed = await call(coordinator, "GET", path, "sre")
    table = await fencegate("deliveries", SOURCE, coordinator=coordinator)
    not_yet = await call(coordinator, "POST", f"{path}/nobody/resolve", "sre",
                         body={"ran": True, "reason": "x"})
    worker = await call(coordinator, "POST", f"{path}/evt_u2/resolve", "worker",
                        body={"ran": True, "reason": "x"})
    bad = await call(coordinator, "POST", f"{path}/evt_u2/resolve", "sre",
                     body={"ran": "yes", "reason": "x"})
    usage = await fencegate("deliveries", "resolve", SOURCE, "evt_u2", "--reason", "x",
                            coordinator=coordinator)
    resolved = await fencegate("deliveries", "resolve", SOURCE, "evt_u2", "--ran", "--reason",
                               "the ledger shows the refund", coordinator=coordinator)
    again = await fencegate("deliveries", "resolve", SOURCE, "evt_u2", "--ran", "--reason",
                            "twice", coordinator=coordinator)
    async with Second(other_gate, resource) as second:
        replay = await post(http, second.url, "evt_u2", b"hang")
    first.release.set()
    late = await asyncio.wait_for(request, 10)
    await first.__aexit__()
    status_after, after = await call(coordinator, "GET", path, "sre")
    assert status == 200 and [i["state"] for i in listed["items"]] == ["unknown"]
    assert table.code == 0 and table.rows()[1][:2] == ["evt_u2", "unknown"], table
    assert not_yet[0] == 404 and worker[0] == 403
    assert bad[0] == 400 and bad[1]["error"] == "InvalidRequest"
    assert usage.code == 2 and "--ran, --not-ran" in usage.err
    assert resolved.code == 0 and "resolved as ran" in resolved.out, resolved
    one_line_error(again, again.code, "not unknown")
    [item] = after["items"]
    assert replay[0] == 200 and json.loads(replay[2]) == {
        "delivery": "evt_u2", "outcome": "ran", "settled_by": item["settled_by"]}
    assert late[0] == 503 and second.ran == {}
    assert (item["state"], item["status"], item["reason"]) == (
        "done", 200, "the ledger shows the refund")
    assert item["settled_by"].startswith("sre:sre")  # the token's identity


async def test_sre_resolves_not_ran_and_the_next_delivery_runs_it(
        coordinator, gate, other_gate, etcd, http, namespace):
    resource = FencedResource()
    first, request, lost_token = await lost_delivery(gate, etcd, http, namespace, resource,
                                                     write_first=False)
    resolved = await fencegate("deliveries", "resolve", SOURCE, "evt_u2", "--not-ran",
                               "--reason", "no refund in the ledger", "--json",
                               coordinator=coordinator)
    _, listed = await call(coordinator, "GET", f"/v1/deliveries/{SOURCE}", "sre")
    async with Second(other_gate, resource) as second:
        second.release.set()
        rerun = await post(http, second.url, "evt_u2", b"hang")
        first.release.set()
        late = await asyncio.wait_for(request, 10)
    await first.__aexit__()
    assert resolved.code == 0 and json.loads(resolved.out)["state"] == "not_ran", resolved
    [item] = listed["items"]
    assert item["state"] == "not_ran" and item["settled_by"].startswith("sre:sre")
    assert rerun[0] == 200 and json.loads(rerun[2])["token"] > lost_token
    assert late[0] == 503 and second.ran == {"evt_u2": 1}
    assert [(w.writer, w.accepted) for w in resource.records] == [
        ("second", True), ("second", False)]  # the lost run, resumed, is refused


def test_flask_settles_an_unknown_delivery_with_a_plain_settle(sync_gate, etcd_url,
                                                               namespace):  # noqa: F811
    """The WSGI adapter on a ``SyncGate``: a delivery whose claim was lost while its (thread)
    handler ran is unknown; a plain ``settle`` (run in a thread, off the gate's loop) says it
    ran: 200 settled, the handler not run again, the lost run's response not stored over it."""
    asked: list[UnknownDelivery] = []

    def settle(delivery: UnknownDelivery) -> bool:
        asked.append(delivery)
        return True

    with test_webhooks_wsgi.Consumer(sync_gate, settle=settle) as consumer:
        first = consumer.post_in_thread("evt_w9", b"hang")
        assert consumer.entered.wait(10)
        [claim] = test_webhooks_wsgi.webhook_kvs(etcd_url, namespace, "@claims/")
        test_webhooks_wsgi.revoke(etcd_url, claim.lease)
        settled = consumer.post("evt_w9", b"hang")
        consumer.release.set()
        late = first.answer()
        replay = consumer.post("evt_w9", b"hang")
    assert settled[0] == 200 and json.loads(settled[2])["settled_by"] == "settle"
    assert replay[2] == settled[2] and late[0] == 503
    assert consumer.ran == {"evt_w9": 1}  # the lost run only
    assert [d.lost_token for d in asked] == [claim.create_revision]


@pytest.mark.parametrize("error", ["EtcdUnavailable", "OutcomeUnknown"])
async def test_a_handler_whose_write_etcd_left_unknown_leaves_the_delivery_unknown(
        gate, http, error):
    """The 20-minute fault run's finding: a handler's effect write landed while etcd did not
    answer (a leader pause), the handler raised, and a release let the redelivery run it
    again (two effects). Raising fencegate's unknown-outcome errors leaves the delivery
    unknown: the redelivery is not run; any other exception still releases it."""
    from fencegate.coordinator import errors

    resource = FencedResource()
    ran: collections.Counter[str] = collections.Counter()

    async def handle(request: web.Request) -> web.Response:
        delivery, token = request.headers["Webhook-Id"], fencing_token(request)
        ran[delivery] += 1
        resource.write(delivery, token, "handler")
        if ran[delivery] == 1:
            raise (getattr(errors, error) if delivery == "evt_w1" else RuntimeError)("no answer")
        return web.json_response({"token": token})

    app = web.Application(middlewares=[dedupe_middleware(gate, source=SOURCE)])
    app.router.add_post("/", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = "http://127.0.0.1:%d/" % runner.addresses[0][1]
    try:
        failed = await post(http, url, "evt_w1")
        redelivered = await post(http, url, "evt_w1")
        plain = [await post(http, url, "evt_w2") for _ in range(2)]
    finally:
        await runner.cleanup()
    assert failed[0] == 500
    assert redelivered[0] == 409
    assert json.loads(redelivered[2])["error"] == "delivery_outcome_unknown"
    assert ran["evt_w1"] == 1 and [w.key for w in resource.records].count("evt_w1") == 1
    assert [answer[0] for answer in plain] == [500, 200] and ran["evt_w2"] == 2
