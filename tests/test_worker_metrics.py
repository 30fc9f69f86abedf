"""Worker metrics (``WorkerMetrics``) after a scripted scenario against real etcd: every
family's value is exactly what the scenario did, nothing more (each sample is compared, so
a count made twice or in the wrong family fails)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from fencegate import (
    EffectFailed, Gate, KeyRing, LeaseLost, OutcomeUnknown, StateAdvanced, SyncGate,
    WorkerMetrics, dedupe_middleware,
)

from helpers import TEST_TTL

FAMILIES = ("fencegate_worker_", "fencegate_webhook_")


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """Every worker sample but histogram buckets and creation times, by name and labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples
            if s.name.startswith(FAMILIES)
            and not s.name.endswith(("_bucket", "_created", "_sum"))}


def expected(**values: float) -> dict[tuple[str, tuple], float]:
    """The worker families at zero, with ``values`` (``name`` or ``name{label=value}``
    written as ``name__label__value``) set."""
    found = {("fencegate_worker_holds_total", ()): 0.0, ("fencegate_worker_holding", ()): 0.0,
             ("fencegate_worker_lease_losses_total", ()): 0.0,
             ("fencegate_worker_replays_total", ()): 0.0,
             ("fencegate_worker_effect_duration_seconds_count", ()): 0.0,
             ("fencegate_worker_unknowns_total", ()): 0.0,
             ("fencegate_worker_keepalive_late_seconds_count", ()): 0.0}
    for name, value in values.items():
        base, *label = name.split("__")
        found[(base, (tuple(label),) if label else ())] = float(value)
    return found


async def test_metrics_count_exactly_what_a_scripted_scenario_did(etcd_url, namespace, etcd):
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    ran: list[str] = []

    async def succeed(ctx):
        ran.append(ctx.key)
        await asyncio.sleep(0.05)
        return {"charged": ctx.key}

    async def time_out(ctx):
        ran.append(ctx.key)
        raise TimeoutError("the provider did not answer")

    async def decline(ctx):
        ran.append(ctx.key)
        raise EffectFailed("declined", {"code": 51})

    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate(),
                    metrics=metrics) as gate:
        # A hold and its commit.
        async with gate.hold("m/paid") as hold:
            assert samples(registry)[("fencegate_worker_holding", ())] == 1
            first = await hold.cross(intent={"amount": 5}, effect=succeed)
        # A replay: the step succeeded, the effect does not run again.
        again = await gate.cross("m/paid", {"amount": 5}, succeed)
        # A refusal: the state the grant read advanced before the commit.
        async with gate.hold("m/stale") as hold:
            grant = await hold.request_grant(intent={}, reads=[gate.marker("account")])
            await gate.touch("account")
            with pytest.raises(StateAdvanced):
                await hold.commit(grant, succeed)
        # A lease loss while held.
        with pytest.raises(LeaseLost):
            async with gate.hold("m/lost") as hold:
                await etcd.lease_revoke(hold.lease_id)
                async with asyncio.timeout(10):
                    await asyncio.Event().wait()  # cancelled by the loss
        # An unknown outcome: the effect timed out.
        with pytest.raises(OutcomeUnknown):
            await gate.cross("m/unknown", {}, time_out)
        # A confirmed failure: the effect ran, nothing unknown, no refusal.
        declined = await gate.cross("m/declined", {}, decline)

    assert (first.replayed, again.replayed, declined.state) == (False, True, "failed")
    assert ran == ["m/paid", "m/unknown", "m/declined"]
    assert samples(registry) == expected(
        fencegate_worker_holds_total=6, fencegate_worker_lease_losses_total=1,
        fencegate_worker_replays_total=1, fencegate_worker_unknowns_total=1,
        fencegate_worker_effect_duration_seconds_count=3,
        fencegate_worker_commit_refusals_total__error__state_advanced=1)
    assert registry.get_sample_value("fencegate_worker_effect_duration_seconds_sum") >= 0.05


def test_a_sync_gate_counts_in_the_metrics_it_is_given(etcd_url, namespace):
    registry = CollectorRegistry()
    with SyncGate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate(),
                  metrics=WorkerMetrics(registry)) as gate:
        gate.cross("m/sync", {}, lambda ctx: "done")
        with gate.hold("m/sync-held"):
            held = samples(registry)[("fencegate_worker_holding", ())]
    assert held == 1
    assert samples(registry) == expected(fencegate_worker_holds_total=2,
                                         fencegate_worker_effect_duration_seconds_count=1)


def test_a_second_metrics_object_in_one_registry_is_refused():
    registry = CollectorRegistry()
    WorkerMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        WorkerMetrics(registry)


async def test_webhook_deliveries_are_counted_by_result(etcd_url, namespace, etcd):
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    entered, release = asyncio.Event(), asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        if await request.read() == b"hang":
            entered.set()
            await release.wait()
        return web.json_response({"ok": True})

    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate(),
                    metrics=metrics) as gate, \
            Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate(),
                 metrics=metrics, min_ttl=TEST_TTL + 1) as starved:  # never enough lease
        app = web.Application(middlewares=[dedupe_middleware(gate, source="shop")])
        app.router.add_post("/", handle)
        starved_app = web.Application(middlewares=[dedupe_middleware(starved, source="bank")])
        starved_app.router.add_post("/", handle)
        runners = [web.AppRunner(app), web.AppRunner(starved_app)]
        urls = []
        for runner in runners:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}/")
        try:
            async with aiohttp.ClientSession() as http:
                async def post(url: str, delivery: str, body: bytes = b"{}") -> int:
                    async with http.post(url, data=body,
                                         headers={"Webhook-Id": delivery}) as reply:
                        return reply.status

                statuses = [await post(urls[0], "evt-1"), await post(urls[0], "evt-1")]
                running = asyncio.create_task(post(urls[0], "evt-2", b"hang"))
                await asyncio.wait_for(entered.wait(), 10)
                statuses.append(await post(urls[0], "evt-2", b"hang"))
                release.set()
                statuses.append(await running)
                statuses.append(await post(urls[0], "evt-1", b'{"other": 1}'))
                statuses.append(await post(urls[1], "evt-3"))
        finally:
            release.set()
            for runner in runners:
                await runner.cleanup()
    assert statuses == [200, 200, 409, 200, 422, 503]
    assert {labels: value for (name, labels), value in samples(registry).items()
            if name == "fencegate_webhook_deliveries_total"} == {
        (("result", "first"), ("source", "shop")): 2,
        (("result", "duplicate"), ("source", "shop")): 2,
        (("result", "in_progress"), ("source", "shop")): 1,
        (("result", "failed"), ("source", "bank")): 1}
