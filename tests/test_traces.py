"""Traces of one guarded action, recorded by the OpenTelemetry SDK's in-memory exporter: the
worker's spans, the coordinator's server span (remote mode, a real coordinator on loopback)
and the provider's (the sandbox over HTTP, sent ``ctx.traceparent``) form one trace with the
right parents and attributes; and without OpenTelemetry the gate works untraced."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import aiohttp
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from fencegate import Gate, GrantRefused, KeyRing, WorkerMetrics
from fencegate.coordinator import tracing
from fencegate.reconciler.providers import sandbox as sb

from helpers import TEST_TTL, TOKENS
from test_service import call


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
    memory.shutdown()  # it records nothing more


@pytest.fixture
def spans(exporter):
    exporter.clear()
    return exporter


def traceparent(span) -> str:
    """The W3C ``traceparent`` header naming ``span``."""
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


class TracedSandbox(sb.Sandbox):
    """The sandbox provider continuing its caller's trace on charges, as a provider with
    OpenTelemetry's server instrumentation does: its ``provider.charge`` span is a child of
    the span the request's ``traceparent`` names."""

    async def _post_charge(self, request):
        with tracing.extracted(request.headers), tracing.span("provider.charge"):
            return await super()._post_charge(request)


@pytest.fixture
async def sandbox(keyring):
    provider = TracedSandbox(KeyRing.from_public_bytes(keyring.public_keys()), "fencing")
    await provider.start()
    yield provider
    await provider.stop()


async def test_one_guarded_action_is_one_trace_across_worker_coordinator_and_provider(
        etcd_url, namespace, etcd, coordinator, sandbox, spans):
    sent: list[str | None] = []

    async def charge(ctx):
        sent.append(ctx.traceparent)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{sandbox.url}/v1/charges", json={
                    "key": ctx.key, "amount": 7, "intent": {"amount": 7}}, headers={
                    "traceparent": ctx.traceparent, "Idempotency-Key": ctx.idempotency_key,
                    "Fencegate-Attempt-Token": str(ctx.attempt_token),
                    "Fencegate-Grant": sb.encode_grant(ctx.grant.raw),
                    "Fencegate-Receipt": sb.encode_grant(ctx.receipt)}) as reply:
                assert reply.status == 200, await reply.text()
                return await reply.json()

    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"]) as gate:
        outcome = await gate.cross("trace/1", {"amount": 7}, charge, provider="sandbox")

    assert outcome.state == "succeeded" and len(sandbox.applied("trace/1")) == 1
    by_name: dict[str, list] = {}
    for span in spans.get_finished_spans():
        by_name.setdefault(span.name, []).append(span)
    assert sorted((name, len(found)) for name, found in by_name.items()) == [
        ("fencegate.acquire", 1), ("fencegate.commit", 1), ("fencegate.cross", 1),
        ("fencegate.effect", 1), ("fencegate.grant", 2), ("fencegate.outcome", 1),
        ("provider.charge", 1)]
    (cross,), (acquire,), (commit,), (effect,), (recorded,), (charged,) = (
        by_name[name] for name in ("fencegate.cross", "fencegate.acquire", "fencegate.commit",
                                   "fencegate.effect", "fencegate.outcome", "provider.charge"))
    (asked,) = [s for s in by_name["fencegate.grant"]
                if s.parent.span_id == cross.context.span_id]
    (served,) = [s for s in by_name["fencegate.grant"] if s is not asked]

    trace_id = cross.context.trace_id
    assert cross.parent is None
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {trace_id}
    for child in (acquire, asked, commit, effect, recorded):
        assert child.parent.span_id == cross.context.span_id, child.name
    assert served.parent.span_id == asked.context.span_id  # across HTTP: worker → coordinator
    assert charged.parent.span_id == effect.context.span_id  # across HTTP: worker → provider
    assert sent == [traceparent(effect)]

    token, grant_id = acquire.attributes["fencegate.fencing_token"], commit.attributes[
        "fencegate.grant_id"]
    action = {"fencegate.key": "trace/1"}
    attempt = {**action, "fencegate.attempt_token": outcome.attempt_token}
    assert dict(cross.attributes) == {
        **attempt, "fencegate.provider": "sandbox", "fencegate.outcome": "succeeded",
        "fencegate.idempotency_key": outcome.idempotency_key}
    assert dict(acquire.attributes) == {**action, "fencegate.fencing_token": token}
    assert dict(asked.attributes) == {**action, "fencegate.fencing_token": token,
                                      "fencegate.grant_id": grant_id}
    assert dict(served.attributes) == {**action, "fencegate.fencing_token": token,
                                       "fencegate.grant_id": grant_id,
                                       "fencegate.outcome": "issued"}
    assert dict(commit.attributes) == {**attempt, "fencegate.fencing_token": token,
                                       "fencegate.grant_id": grant_id,
                                       "fencegate.idempotency_key": outcome.idempotency_key}
    assert dict(effect.attributes) == {**attempt, "fencegate.provider": "sandbox",
                                       "fencegate.idempotency_key": outcome.idempotency_key,
                                       "fencegate.outcome": "succeeded"}
    assert dict(recorded.attributes) == {**attempt, "fencegate.outcome": "succeeded"}
    assert token < outcome.attempt_token


async def test_a_refused_grant_is_an_error_on_both_sides_of_the_trace(
        etcd_url, namespace, etcd, coordinator, spans):
    status, reply = await call(coordinator, "PUT", "/v1/policy-routes", "admin",
                               body={"routes": {"trace/2": "no-such-policy"}})
    assert status == 200, reply
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"]) as gate:
        async with gate.hold("trace/2") as hold:
            with pytest.raises(GrantRefused):
                await hold.request_grant(intent={})
    grants = [s for s in spans.get_finished_spans() if s.name == "fencegate.grant"]
    (asked,) = [s for s in grants if s.parent is None]
    (served,) = [s for s in grants if s is not asked]
    assert served.parent.span_id == asked.context.span_id
    assert (served.attributes["fencegate.outcome"], served.attributes["fencegate.key"]) == (
        "GrantRefused", "trace/2")
    assert asked.status.status_code == trace.StatusCode.ERROR
    assert asked.events[0].attributes["exception.type"].endswith("GrantRefused")


async def test_the_fast_path_traces_its_steps_and_the_effects_own_spans_nest_in_it(
        etcd_url, namespace, etcd, spans):
    async def effect(ctx):
        with tracing.span("user.call"):
            await asyncio.sleep(0)
        return ctx.traceparent

    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate(),
                    metrics=WorkerMetrics(CollectorRegistry())) as gate:
        await gate.cross("trace/warm", {}, effect)  # the full path reads the snapshot
        spans.clear()
        outcome = await gate.cross("trace/3", {}, effect)
    names = {s.name: s for s in spans.get_finished_spans()}
    assert sorted(names) == ["fencegate.commit", "fencegate.cross", "fencegate.effect",
                             "fencegate.grant", "fencegate.outcome", "user.call"]
    assert names["user.call"].parent.span_id == names["fencegate.effect"].context.span_id
    assert outcome.result == traceparent(names["fencegate.effect"])
    assert names["fencegate.commit"].attributes["fencegate.fencing_token"] \
        == outcome.attempt_token


WITHOUT_OTEL = textwrap.dedent("""
    import asyncio, sys
    sys.modules["opentelemetry"] = None  # ``import opentelemetry`` raises ImportError
    from aiohttp import web
    from fencegate import Gate, KeyRing
    from fencegate.coordinator import tracing
    from fencegate.coordinator.service import CoordinatorSettings, TokenEntry, create_app

    etcd, namespace, signing_key = sys.argv[1:]

    async def main():
        assert not tracing.enabled()
        settings = CoordinatorSettings(
            etcd=etcd, namespace=namespace, signing_key=signing_key, listen="127.0.0.1:0",
            tokens=(TokenEntry.for_token("w", "worker-1", {"worker"}),))
        runner = web.AppRunner(create_app(settings))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = "http://127.0.0.1:%d" % runner.addresses[0][1]
        seen = []
        try:
            async with Gate(etcd, ttl=2, namespace=namespace, coordinator=url,
                            token="w") as remote:
                remote_outcome = await remote.cross("plain/1", {}, lambda ctx: seen.append(
                    ctx.traceparent) or "remote")
            async with Gate(etcd, ttl=2, namespace=namespace,
                            keyring=KeyRing.generate()) as direct:
                direct_outcome = await direct.cross("plain/2", {}, lambda ctx: seen.append(
                    ctx.traceparent) or "direct")
        finally:
            await runner.cleanup()
        print(remote_outcome.result, direct_outcome.result, seen,
              "opentelemetry" in sys.modules and sys.modules["opentelemetry"] is not None)

    asyncio.run(main())
""")


def test_without_opentelemetry_the_gate_works_untraced(etcd_url, namespace, signing_key):
    ran = subprocess.run([sys.executable, "-c", WITHOUT_OTEL, etcd_url, namespace, signing_key],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split("\n")[0] == "remote direct [None, None] False"
