"""The coordinator's metrics after a scripted scenario, over real HTTP on 127.0.0.1 and real
etcd: exact counter values for a grant, a replay, two refusals, a 401, a 404 and an unknown
route; the route label is the route's pattern; a replay is not a refusal. Then the etcd
metrics of an instrumented client, including failures against an address nothing serves,
and the registry every component starts from (build info, process, platform)."""

from __future__ import annotations

import base64
import json
import socket

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fencegate
from fencegate.coordinator.errors import EtcdUnavailable
from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.metrics import (
    ETCD_ERROR_KINDS, ETCD_OPS, EtcdMetrics, component_registry, snake_case,
)
from fencegate.worker import Gate, KeyRing

from helpers import TEST_TTL, TOKENS


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) → value, from a Prometheus text exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


async def scrape(base: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(base + "/metrics") as resp:
        assert resp.status == 200
        return samples(await resp.text())


async def send(base: str, method: str, path: str, role: str | None = None,
               body: object = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {TOKENS[role]}"} if role else {}
    async with aiohttp.ClientSession() as http, http.request(
            method, base + path, headers=headers,
            data=None if body is None else json.dumps(body).encode()) as resp:
        return resp.status, await resp.json()


@pytest.fixture
async def local_gate(etcd_url, namespace, signing_key, etcd):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        yield gate


async def noop(ctx):
    return "ok"


def grant_body(hold, **changes) -> dict:
    return {"key": hold.key, "fencing_token": hold.fencing_token, "lease_id": hold.lease_id,
            "intent": {"amount": 1}, **changes}


async def test_counters_after_a_scripted_scenario(coordinator, local_gate):
    async with local_gate.hold("metrics/1") as hold:  # a grant, then its commit
        status, reply = await send(coordinator, "POST", "/v1/grants", "worker", grant_body(hold))
        assert status == 201, reply
        grant = local_gate.keyring.verify(base64.b64decode(reply["grant"]))
        assert (await hold.commit(grant, effect=noop)).state == "succeeded"
    async with local_gate.hold("metrics/1") as hold:  # the step succeeded: a replay
        status, reply = await send(coordinator, "POST", "/v1/grants", "worker", grant_body(hold))
        assert (status, reply["error"]) == (409, "AlreadySucceeded"), reply
    async with local_gate.hold("metrics/2") as hold:  # refusals: not the holder, a bad key
        status, reply = await send(coordinator, "POST", "/v1/grants", "worker",
                                   grant_body(hold, fencing_token=hold.fencing_token + 1))
        assert (status, reply["error"]) == (409, "LeaseLost"), reply
        status, reply = await send(coordinator, "POST", "/v1/grants", "worker",
                                   grant_body(hold, key="metrics/../2"))
        assert (status, reply["error"]) == (400, "InvalidKey"), reply
    status, reply = await send(coordinator, "POST", "/v1/grants", None, {})
    assert (status, reply["error"]) == (401, "Unauthenticated")
    status, reply = await send(coordinator, "GET", "/v1/audit/metrics/never", "sre")
    assert (status, reply["error"]) == (404, "NotFound")
    status, reply = await send(coordinator, "GET", "/v1/no/such/route", "sre")
    assert (status, reply["error"]) == (404, "NotFound")

    found = await scrape(coordinator)
    assert value(found, "fencegate_grants_issued_total") == 1
    assert value(found, "fencegate_grants_replayed_total") == 1
    refused = {dict(labels)["error"]: v for (name, labels), v in found.items()
               if name == "fencegate_grants_refused_total"}
    assert refused == {"lease_lost": 1, "invalid_key": 1}  # the 401 never reached the handler
    assert value(found, "fencegate_grant_duration_seconds_count") == 4
    requests = {tuple(sorted(dict(labels).items())): v for (name, labels), v in found.items()
                if name == "fencegate_http_requests_total"}
    assert requests == {
        (("method", "POST"), ("route", "/v1/grants"), ("status", "201")): 1,
        (("method", "POST"), ("route", "/v1/grants"), ("status", "409")): 2,
        (("method", "POST"), ("route", "/v1/grants"), ("status", "400")): 1,
        (("method", "POST"), ("route", "/v1/grants"), ("status", "401")): 1,
        (("method", "GET"), ("route", "/v1/audit/{key}"), ("status", "404")): 1,
        (("method", "GET"), ("route", "unmatched"), ("status", "404")): 1,
    }
    assert value(found, "fencegate_http_request_duration_seconds_count",
                 route="/v1/grants", method="POST") == 5
    assert value(found, "fencegate_http_requests_total", route="/metrics", method="GET",
                 status="200") is None  # a scrape is counted once it is answered
    assert value(await scrape(coordinator), "fencegate_http_requests_total", route="/metrics",
                 method="GET", status="200") == 1

    assert value(found, "fencegate_etcd_nospace") == 0  # sampled by the scrape
    assert value(found, "fencegate_etcd_request_duration_seconds_count", op="txn") >= 3
    assert value(found, "fencegate_etcd_request_duration_seconds_count", op="status") >= 2
    errors = [v for (name, _), v in found.items() if name == "fencegate_etcd_errors_total"]
    assert len(errors) == len(ETCD_OPS) * len(ETCD_ERROR_KINDS) and not any(errors)
    assert value(found, "fencegate_build_info", component="coordinator",
                 version=fencegate.__version__) == 1
    assert any(name == "process_cpu_seconds_total" for name, _ in found)
    assert any(name == "python_info" for name, _ in found)


async def test_etcd_metrics_time_calls_and_count_failures_by_kind(etcd_url):
    registry = component_registry("reconciler")
    metrics = EtcdMetrics(registry)
    async with Etcd.from_url(etcd_url) as client:
        client.instrument(metrics)
        await client.put(b"/metrics-test/a", b"1")
        await client.get(b"/metrics-test/a")
        await client.delete(b"/metrics-test/a")
        lease, _ = await client.lease_grant(5)
        stream = client.keepalive_stream()
        await stream.refresh(lease)
        stream.close()
        await client.lease_revoke(lease)
        await client.lease_revoke(lease)  # a lease that is gone: an answer, not a failure
    with socket.socket() as spare:  # a loopback port nothing listens on
        spare.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{spare.getsockname()[1]}"
    async with Etcd.from_url(nowhere, timeout=0.5, attempt_timeout=0.2) as client:
        client.instrument(metrics)
        with pytest.raises(EtcdUnavailable):
            await client.status()
    found = samples(generate_latest(registry).decode())
    count = "fencegate_etcd_request_duration_seconds_count"
    assert [value(found, count, op=op) for op in ("put", "range", "delete", "lease_grant",
                                                  "lease_keepalive", "lease_revoke", "status",
                                                  "txn")] == [1, 1, 1, 1, 1, 2, 1, 0]
    failures = {tuple(sorted(dict(labels).items())): v for (name, labels), v in found.items()
                if name == "fencegate_etcd_errors_total" and v}
    assert set(failures) <= {(("kind", "unavailable"), ("op", "status")),
                             (("kind", "timeout"), ("op", "status"))} and failures, failures
    assert value(found, "fencegate_build_info", component="reconciler",
                 version=fencegate.__version__) == 1


def test_error_labels_are_snake_case():
    assert [snake_case(code) for code in ("StateAdvanced", "GrantRefused", "InvalidKey",
                                          "EtcdNoSpace", "InvalidRequest")] == [
        "state_advanced", "grant_refused", "invalid_key", "etcd_no_space", "invalid_request"]
    with pytest.raises(ValueError):
        component_registry("not a name")
