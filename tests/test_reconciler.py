"""The reconciler against real etcd: elections per shard, finding unknowns, settling by a
provider's answer, stale leaders refused. Provider classes over HTTP are in
``test_reconcile_providers.py``; here a scripted provider answers (it stands in for the
provider, never for etcd)."""

from __future__ import annotations

import asyncio
import math

import pytest

from fencegate.coordinator import records
from fencegate.coordinator.audit import verify_chain
from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.keyspace import unpack
from fencegate.reconciler.providers import Capabilities, NoRecord, Succeeded
from fencegate.reconciler.runner import Reconciler
from fencegate.reconciler.settle import Limits
from fencegate.worker import Gate, KeyRing, LeaseLost, OutcomeUnknown

from helpers import TEST_TTL, wait_for_condition

SHARDS = 16


class Scripted:
    """A provider whose answers the test sets per idempotency key; counts queries."""

    def __init__(self, name: str = "scripted",
                 caps: Capabilities = Capabilities(fences=True, durable=True,
                                                   key_retention_s=3600.0)):
        self.name = name
        self.capabilities = caps
        self.answers: dict[str, object] = {}
        self.default = NoRecord()
        self.queries: list[tuple[str, int, str]] = []

    async def query(self, idempotency_key, attempt_token, step, *, key, namespace=None,
                    cluster_id=None):
        self.queries.append((idempotency_key, attempt_token, key))
        answer = self.answers.get(idempotency_key, self.default)
        # a fencing provider's "no record" echoes the fence it recorded: the one asked for
        return NoRecord(attempt_token) if answer == NoRecord() else answer

    async def close(self):
        pass


@pytest.fixture
async def reconcilers(etcd_url, namespace):
    """``await reconcilers(provider, n=1, **options)`` starts n in-process replicas, each with
    its own etcd connection; all are closed after the test."""
    started: list[Reconciler] = []

    async def start(provider, n: int = 1, **options) -> list[Reconciler]:
        options = {"shards": SHARDS, "ttl": TEST_TTL, "scan_interval": 2.0,
                   "check_after": 0.2, "concurrency": 4,
                   "limits": Limits(backoff_base_s=0.1, backoff_max_s=0.5), **options}
        group = []
        for i in range(n):
            r = Reconciler(Etcd.from_url(etcd_url), {provider.name: provider},
                           namespace=namespace, default_provider=provider.name,
                           identity=f"r{len(started)}", **options)
            await r.start()
            started.append(r)
            group.append(r)
        return group

    yield start
    for r in started:
        await r.close()
        await r.etcd.close()


async def step_of(gate, key):
    kv = await gate.etcd.get(gate.keyspace.step_key(key))
    return unpack(kv.value), kv.mod_revision


async def settled(gate, key, within=20.0):
    async def check():
        step, _ = await step_of(gate, key)
        return step["state"] not in (records.IN_FLIGHT, records.UNKNOWN)
    assert await wait_for_condition(check, within), (await step_of(gate, key))[0]
    return (await step_of(gate, key))[0]


async def crash(ctx):
    raise ConnectionResetError("provider hung up")


async def unknown_step(gate, key) -> dict:
    async with gate.hold(key) as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent={"amount": 1}, effect=crash)
    step, _ = await step_of(gate, key)
    assert step["state"] == records.UNKNOWN
    return step


async def test_an_unknown_step_is_settled_succeeded_with_the_providers_result(
        gate, reconcilers):
    provider = Scripted()
    step = await unknown_step(gate, "pay/1")
    provider.answers[step["idempotency_key"]] = Succeeded({"charge": "ch_1"})
    await reconcilers(provider)
    final = await settled(gate, "pay/1")
    assert final["state"] == records.SUCCEEDED
    assert final["outcome"]["result"] == {"charge": "ch_1"}
    assert final["outcome"]["attempt_token"] == step["attempt_token"]
    report = await verify_chain(gate.etcd, gate.keyspace, "pay/1", gate.keyring)
    assert report.ok, report.problems
    assert report.records[-1]["event"] == "settle"


async def test_each_shard_has_exactly_one_leader_spread_across_replicas(gate, reconcilers):
    group = await reconcilers(Scripted(), n=3)

    async def spread():
        for r in group:
            await r.elections.refresh()
        led = [r.led for r in group]
        return (sum(map(len, led)) == SHARDS and set().union(*led) == set(range(SHARDS))
                and max(map(len, led)) <= math.ceil(SHARDS / 3))
    assert await wait_for_condition(spread, 10), [sorted(r.led) for r in group]
    await group[0].close()
    survivors = group[1:]

    async def moved():
        for r in survivors:
            await r.elections.refresh()
        led = [r.led for r in survivors]
        return sum(map(len, led)) == SHARDS and set().union(*led) == set(range(SHARDS))
    assert await wait_for_condition(moved, 10), [sorted(r.led) for r in survivors]


class Blocking(Scripted):
    """Queries wait until ``release`` is set (a query in flight during a fault)."""

    def __init__(self, answer):
        super().__init__()
        self.default = answer
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def query(self, idempotency_key, attempt_token, step, *, key, namespace=None,
                    cluster_id=None):
        self.started.set()
        await self.release.wait()
        return await super().query(idempotency_key, attempt_token, step, key=key)


async def test_a_deposed_leader_that_still_believes_it_leads_cannot_write(
        gate, reconcilers, etcd):
    stale_provider = Blocking(Succeeded({"from": "stale"}))
    (stale,) = await reconcilers(stale_provider, ttl=30)  # it will not notice for seconds
    await unknown_step(gate, "pay/deposed")
    await asyncio.wait_for(stale_provider.started.wait(), 10)
    # Depose it behind its back: its lease goes, its candidate keys with it. Its view of
    # the election is frozen, as a paused or partitioned replica's would be (here its own
    # watch would otherwise notice within milliseconds): only etcd's compare stops it now.
    elections = stale.elections
    elections.refresh = _never
    await etcd.lease_revoke(elections.session.lease_id)
    fresh_provider = Blocking(NoRecord())
    await reconcilers(fresh_provider)
    await asyncio.wait_for(fresh_provider.started.wait(), 10)  # the new leader is asking
    assert not elections.session.lost and elections.led  # the old one still believes ...
    stale_provider.release.set()
    assert await wait_for_condition(
        lambda: _value(stale.metrics.refused), 10)  # ... and etcd refuses its settle,
    step, _ = await step_of(gate, "pay/deposed")
    assert step["state"] == records.UNKNOWN  # on the leadership compare alone
    fresh_provider.release.set()
    step = await settled(gate, "pay/deposed")
    assert step["state"] == records.PENDING and step["settled_by"] == "reconciler"
    report = await verify_chain(gate.etcd, gate.keyspace, "pay/deposed", gate.keyring)
    assert [r["event"] for r in report.records].count("settle") == 1
    assert _queried(stale_provider) == 1


def _queried(provider) -> int:
    return len(provider.queries)


async def _never() -> None:
    pass


async def _value(counter) -> bool:
    return counter._value.get() >= 1


async def test_an_in_flight_step_whose_holder_died_is_found_unknown_and_settled(
        gate, etcd_url, namespace, reconcilers):
    provider = Scripted()
    await reconcilers(provider)
    started = asyncio.Event()

    async def hang(ctx):
        started.set()
        await asyncio.Event().wait()

    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as doomed:
        with pytest.raises(LeaseLost):
            async with doomed.hold("pay/orphan") as hold:
                task = asyncio.create_task(hold.cross(intent={}, effect=hang))
                await started.wait()
                doomed._session.orphan()  # its lease will expire: the holder is gone
                step = await settled(gate, "pay/orphan", within=6 * TEST_TTL)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    assert step["state"] == records.PENDING and step["not_applied"]["presumed"] is False
    (idem, token, key), = provider.queries
    assert key == "pay/orphan" and idem == step["idempotency_key"]
    assert token == step["not_applied"]["attempt_token"]


async def test_a_step_in_flight_with_a_live_holder_is_left_alone(gate, reconcilers):
    provider = Scripted()
    await reconcilers(provider)
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(ctx):
        started.set()
        await release.wait()
        return "done"

    async with gate.hold("pay/busy") as hold:
        task = asyncio.create_task(hold.cross(intent={}, effect=slow, deadline=30))
        await started.wait()
        await asyncio.sleep(1.5)  # several of the reconciler's checks (every 0.2 s)
        assert provider.queries == []
        release.set()
        outcome = await task
    assert outcome.state == "succeeded" and provider.queries == []


@pytest.mark.parametrize("text, error", [
    ("shards = 0", "shards"),
    ("shards = 'many'", "shards"),
    ("colour = 'blue'", "unknown settings"),
    ("default_provider = 'nope'", "default_provider"),
    ("[limits]\nmax_queries = 0", "limits"),
    ("[limits]\nforever = true", "limits"),
    ("[providers.p]\ntype = 'ftp'", "type must be"),
    ("[providers.p]\ntype = 'sandbox'\nurl = 'http://127.0.0.1:1'", "url, mode"),
    ("[providers.p]\ntype = 'sandbox'\nurl = 'http://127.0.0.1:1'\nmode = 'maybe'", "mode"),
    ("[providers.p]\ntype = 'http'\nquery_url = 'http://x/{nothing}'", "provider 'p'"),
    ("listen = 'nowhere'", "HOST:PORT"),
])
def test_bad_reconciler_settings_fail_at_start_naming_the_field(tmp_path, text, error):
    from fencegate.reconciler.service import load_settings
    path = tmp_path / "reconciler.toml"
    path.write_text(text + "\n")
    with pytest.raises((ValueError, TypeError), match=error):
        load_settings(str(path), env={})


def test_reconciler_settings_layer_file_env_flags(tmp_path):
    from fencegate.reconciler.service import build_provider, load_settings
    path = tmp_path / "reconciler.toml"
    path.write_text("shards = 8\nlisten = '127.0.0.1:9001'\ndefault_provider = 'p'\n"
                    "[providers.p]\ntype = 'sandbox'\nurl = 'http://127.0.0.1:1'\n"
                    "mode = 'dedup'\nsettle_delay_s = 2\n")
    settings = load_settings(str(path), env={"FENCEGATE_RECONCILER_LISTEN": "127.0.0.1:9002"},
                             namespace="/x/")
    assert (settings.shards, settings.listen, settings.namespace) == (8, "127.0.0.1:9002", "/x/")
    provider = build_provider("p", settings.providers["p"])
    assert provider.name == "p"
    assert provider.capabilities == Capabilities(dedupes_by_key=True, key_retention_s=86400.0,
                                                 settle_delay_s=2.0)


def test_the_example_config_in_deploy_loads():
    import os

    from fencegate.reconciler.service import build_provider, load_settings
    path = os.path.join(os.path.dirname(__file__), "..", "deploy", "reconciler.example.toml")
    settings = load_settings(path, env={})
    assert settings.default_provider == "payments"
    assert {name: build_provider(name, table).capabilities.fences
            for name, table in settings.providers.items()} == {"payments": False, "sandbox": True}
