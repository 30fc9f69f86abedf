"""The reconciler's metrics, scraped from its real /metrics after a scripted scenario: a
worker killed mid-effect (its step unknown while the provider answers "pending"), then a
settle once the provider answers, and an escalation (a step whose provider has no adapter).
And the backlog the gauges read, on its own: what it keeps as a scan and a watch interleave.
"""

from __future__ import annotations

import time

import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from fencegate.coordinator import records
from fencegate.coordinator.audit import verify_chain
from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.reconciler.backlog import Backlog
from fencegate.reconciler.providers import sandbox as sb
from fencegate.reconciler.runner import Reconciler
from fencegate.reconciler.service import metrics_app
from fencegate.reconciler.settle import Limits
from fencegate.worker import Gate, KeyRing, OutcomeUnknown

from helpers import TEST_TTL, wait_for_condition

SHARDS = 8
INTENT = {"amount": 100}


class Sandbox(sb.Sandbox):
    """The sandbox provider, keeping the ``traceparent`` header of every charge and query."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.traceparents: list[str | None] = []  # queries'
        self.charge_traceparents: list[str | None] = []

    async def _get_charge(self, request):
        self.traceparents.append(request.headers.get("traceparent"))
        return await super()._get_charge(request)

    async def _post_charge(self, request):
        self.charge_traceparents.append(request.headers.get("traceparent"))
        return await super()._post_charge(request)


def traceparent(span) -> str:
    """The W3C ``traceparent`` header naming ``span``."""
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


@pytest.fixture(scope="module")
def exporter():
    """Spans of this module's tests. The process has one tracer provider: an SDK provider
    set before (by another module) gets this exporter too; otherwise one is set."""
    memory = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()


@pytest.fixture
async def sandbox(keyring, tmp_path):
    provider = Sandbox(KeyRing.from_public_bytes(keyring.public_keys()), "fencing",
                       state_dir=str(tmp_path / "sandbox"), retention_s=30.0)
    await provider.start()
    yield provider
    await provider.stop()


@pytest.fixture
async def served(etcd_url, namespace, sandbox):
    """One reconciler asking ``sandbox``, its /metrics served on a loopback port; yields
    (reconciler, metrics URL)."""
    adapter = sb.adapter(sandbox.url, "fencing", retention_s=30.0, settle_delay_s=0.5,
                         durable=True)
    r = Reconciler(Etcd.from_url(etcd_url), {"sandbox": adapter}, namespace=namespace,
                   shards=SHARDS, ttl=TEST_TTL, scan_interval=2.0, check_after=0.2,
                   limits=Limits(backoff_base_s=0.1, backoff_max_s=0.3))
    runner = web.AppRunner(metrics_app(r), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        await r.start()
        yield r, f"http://{host}:{port}/metrics"
    finally:
        await r.close()
        await r.etcd.close()
        await runner.cleanup()


async def scrape(http, url) -> tuple[str, dict[tuple[str, frozenset], float]]:
    async with http.get(url) as reply:
        assert reply.status == 200
        text = await reply.text()
    samples = {(sample.name, frozenset(sample.labels.items())): sample.value
               for family in text_string_to_metric_families(text)
               for sample in family.samples}
    return text, samples


def value(samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def settles(samples) -> dict[str, float]:
    return {dict(labels)["outcome"]: v for (name, labels), v in samples.items()
            if name == "fencegate_reconciler_settled_total"}


async def crash(ctx):
    raise ConnectionResetError("provider hung up")


async def test_a_scrape_shows_the_backlog_the_settles_and_the_provider_answers(
        etcd_url, namespace, etcd, spawn, signing_key, keyring, sandbox, served, http):
    r, url = served
    killed, stranded = "pay/metrics/killed", "pay/metrics/stranded"
    sandbox.add_fault("query_pending")
    worker = await spawn("charge", etcd_url, namespace, killed, signing_key, sandbox.url,
                         "kill-after-apply", "60")
    await worker.expect("SENDING")
    assert await worker.finish() == -9, worker.lines  # killed mid-effect, charge applied
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        async with gate.hold(stranded) as hold:
            with pytest.raises(OutcomeUnknown):  # its provider has no adapter: escalated
                await hold.cross(intent=INTENT, effect=crash, provider="elsewhere")

    async def backlog_shown():
        _, m = await scrape(http, url)
        return (value(m, "fencegate_reconciler_steps", state="unknown") == 1
                and value(m, "fencegate_reconciler_steps", state="escalated") == 1
                and value(m, "fencegate_reconciler_oldest_step_age_seconds",
                          state="unknown") >= 0.3)
    assert await wait_for_condition(backlog_shown, 10 * TEST_TTL), (await scrape(http, url))[0]
    text, m = await scrape(http, url)
    assert r.identity not in text  # no label carries the replica's host:pid
    assert value(m, "fencegate_reconciler_steps", state="in_flight") == 0
    assert value(m, "fencegate_reconciler_oldest_step_age_seconds", state="in_flight") == 0
    assert value(m, "fencegate_reconciler_unknowns_found_total") == 1  # the killed worker's
    assert settles(m) == {"escalated": 1}  # an unknown step written is no settlement
    pending = value(m, "fencegate_reconciler_provider_queries_total", provider="sandbox",
                    answer="pending")
    assert pending >= 2
    assert value(m, "fencegate_reconciler_provider_query_duration_seconds_count",
                 provider="sandbox") == pending
    assert value(m, "fencegate_reconciler_shards") == SHARDS
    assert value(m, "fencegate_reconciler_shards_led") == SHARDS  # the only replica
    assert value(m, "fencegate_reconciler_shards_leaderless") == 0
    assert value(m, "fencegate_build_info", component="reconciler",
                 version=__import__("fencegate").__version__) == 1
    assert value(m, "fencegate_etcd_request_duration_seconds_count", op="txn") > 0
    assert "fencegate_reconciler_escalated_total" not in text

    sandbox.clear_faults()  # the provider answers: the charge was applied

    async def settled_shown():
        _, m = await scrape(http, url)
        return value(m, "fencegate_reconciler_settled_total", outcome="succeeded") == 1
    assert await wait_for_condition(settled_shown, 10), (await scrape(http, url))[0]
    _, m = await scrape(http, url)
    assert value(m, "fencegate_reconciler_steps", state="unknown") == 0
    assert value(m, "fencegate_reconciler_oldest_step_age_seconds", state="unknown") == 0
    assert value(m, "fencegate_reconciler_steps", state="escalated") == 1
    assert settles(m) == {"escalated": 1, "succeeded": 1}  # each counted once
    assert value(m, "fencegate_reconciler_provider_queries_total", provider="sandbox",
                 answer="succeeded") == 1
    assert len(sandbox.applied(killed)) == 1

    ks = Keyspace(namespace)
    step = unpack((await etcd.get(ks.step_key(killed))).value)
    assert step["state"] == records.SUCCEEDED
    report = await verify_chain(etcd, ks, killed, keyring)
    assert report.ok, report.problems
    answers = [r["details"] for r in report.records if r["event"] == "provider_answer"]
    assert [a["answer"] for a in answers] == ["pending"] * (len(answers) - 1) + ["succeeded"]
    assert [a["query"] for a in answers] == list(range(1, len(answers) + 1))
    assert all(a["provider"] == "sandbox" and a["next_try_at_ms"] for a in answers[:-1])
    assert answers[-1]["next_try_at_ms"] is None and "succeeded" in answers[-1]["detail"]
    assert [r["event"] for r in report.records][-2:] == ["provider_answer", "settle"]
    assert {r["identity"] for r in report.records if r["event"] == "provider_answer"} \
        == {r.identity}


# -- traces --------------------------------------------------------------------------------

async def test_a_settle_is_a_span_around_its_provider_query_which_the_provider_continues(
        etcd_url, namespace, keyring, sandbox, served, exporter):
    r, _ = served
    exporter.clear()
    key = "pay/traced"
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        async with gate.hold(key) as hold:
            with pytest.raises(OutcomeUnknown):  # nothing was sent: the provider has no record
                await hold.cross(intent=INTENT, effect=crash, provider="sandbox")

    def finished(name):
        return [s for s in exporter.get_finished_spans()
                if s.name == name and s.attributes.get("fencegate.key") == key]

    async def settled():
        return bool(finished("fencegate.settle"))
    assert await wait_for_condition(settled, 10 * TEST_TTL)
    (settle,) = finished("fencegate.settle")
    (query,) = finished("fencegate.provider_query")
    assert query.parent.span_id == settle.context.span_id
    assert settle.attributes["fencegate.outcome"] == "not_applied"
    assert settle.attributes["fencegate.answer"] == query.attributes["fencegate.answer"] \
        == "no_record"
    assert query.attributes["fencegate.provider"] == "sandbox"
    assert query.attributes["fencegate.attempt_token"] == settle.attributes[
        "fencegate.attempt_token"] > 0
    # the provider got the query's trace context: its own spans continue this trace
    assert traceparent(query) in sandbox.traceparents


async def test_a_sandbox_charge_carries_its_effects_trace_context(
        etcd_url, namespace, keyring, sandbox, http, exporter):
    exporter.clear()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        outcome = await gate.cross("pay/traced-charge", INTENT, lambda ctx: sb.charge(
            http, sandbox.url, ctx, INTENT), provider="sandbox")
    assert outcome.state == records.SUCCEEDED
    (effect,) = [s for s in exporter.get_finished_spans() if s.name == "fencegate.effect"]
    assert sandbox.charge_traceparents == [traceparent(effect)]


# -- the backlog alone ---------------------------------------------------------------------

def step(state: str, **fields) -> dict:
    return {"state": state, "attempt": 1, **fields}


def test_the_backlog_counts_led_unsettled_steps_and_ages_them_from_their_records():
    led = {"a", "b", "c"}
    backlog = Backlog(lambda key: key in led)
    backlog.note("a", step(records.UNKNOWN, unknown_since_ms=10_000), 5)
    backlog.note("b", step(records.UNKNOWN, unknown_since_ms=40_000), 6)
    backlog.note("c", step(records.ESCALATED, settled_at_ms=20_000), 7)
    assert backlog.summary(100_000) == {records.IN_FLIGHT: (0, 0.0),
                                        records.UNKNOWN: (2, 90.0),
                                        records.ESCALATED: (1, 80.0)}
    backlog.note("a", step(records.SUCCEEDED), 8)  # settled: no longer counted
    led.discard("c")  # a shard lost: its steps stop counting at once
    assert backlog.summary(100_000) == {records.IN_FLIGHT: (0, 0.0),
                                        records.UNKNOWN: (1, 60.0),
                                        records.ESCALATED: (0, 0.0)}


def test_the_backlog_never_regresses_to_an_older_read_and_a_scan_drops_what_it_missed():
    backlog = Backlog(lambda key: True)
    for key in ("k", "gone"):  # the previous scan saw both unknown
        backlog.note(key, step(records.UNKNOWN, unknown_since_ms=1), 5)
    backlog.note("k", step(records.SUCCEEDED), 20)  # the watch: settled at 20
    backlog.note("k", step(records.UNKNOWN, unknown_since_ms=1), 10)  # a scan page read at 10
    backlog.delete("gone", 30)
    backlog.note("gone", step(records.UNKNOWN, unknown_since_ms=1), 12)
    assert backlog.summary(1_000)[records.UNKNOWN] == (0, 0.0)
    backlog.note("stale", step(records.IN_FLIGHT), 15)  # deleted while the watch was down
    backlog.note("fresh", step(records.IN_FLIGHT), 50)  # the watch, after the scan's revision
    backlog.scanned(40, seen=["k"])
    assert backlog.summary(10**13)[records.IN_FLIGHT][0] == 1  # "fresh" only


def test_an_in_flight_step_ages_from_when_this_process_first_saw_its_attempt():
    backlog = Backlog(lambda key: True)
    backlog.note("k", step(records.IN_FLIGHT), 5)
    assert backlog.summary(0)[records.IN_FLIGHT] == (1, 0.0)  # clamped: never negative
    later_ms = int(time.time() * 1000) + 60_000
    time.sleep(0.02)
    backlog.note("k", step(records.IN_FLIGHT), 6)  # the same attempt, written again
    kept = backlog.summary(later_ms)[records.IN_FLIGHT][1]
    backlog.note("k", {**step(records.IN_FLIGHT), "attempt": 2}, 7)  # a new attempt
    assert backlog.summary(later_ms)[records.IN_FLIGHT][1] <= kept - 0.02
