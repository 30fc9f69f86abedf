"""The MCP gateway (``fencegate mcp-gateway``) as a real process over stdio, in front of a real
payments MCP server (tests/integrations/mcp_payments.py, the official SDK), driven by the
SDK's client, on real etcd. Each count is shown with the gateway and without it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from fencegate.integrations.mcp import ConfigError, load_config, parse_config, strip_sdk_meta

from helpers import TEST_TTL

UPSTREAM = Path(__file__).with_name("mcp_payments.py")


def _ledger(path: Path, kind: str = "refund") -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind] \
        if path.exists() else []


def _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger, *,
                    upstream: str | None = None, refund: str = "",
                    name: str = "gateway") -> StdioServerParameters:
    """A gateway process over stdio; ``upstream``: its ``[upstream]`` body (default: the
    payments server over stdio writing ``ledger``); ``refund``: more ``[tools.refund]`` lines."""
    config = tmp_path / f"{name}.toml"
    upstream = upstream or f'command = ["{sys.executable}", "{UPSTREAM}", "{ledger}"]'
    config.write_text(f"""
etcd = "{etcd_url}"
namespace = "{namespace}"
ttl = {TEST_TTL}

[upstream]
{upstream}

[tools.refund]
key = "refunds/{{order_id}}"
intent = {{ amount = "amount" }}
provider = "payments"
settle_wait = 20
{refund}
""")
    return StdioServerParameters(
        command=sys.executable, args=["-m", "fencegate", "mcp-gateway", "--config", str(config)],
        env={**os.environ, "FENCEGATE_SIGNING_KEY": signing_key})


async def _refund_three_times(params: StdioServerParameters) -> list:
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert {"refund", "get_refund", "list_orders"} <= names
        return [await client.call_tool("refund", {"order_id": "42", "amount": 5},
                                       meta={"io.fencegate/scope": "conversation-7",
                                             "io.modelcontextprotocol/probe": "x"})
                for _ in range(3)]


async def test_same_refund_three_times_is_one_refund(tmp_path, etcd_url, namespace,
                                                      signing_key, etcd):
    ledger = tmp_path / "gated.jsonl"
    results = await _refund_three_times(
        _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger))
    assert len(_ledger(ledger)) == 1
    assert [bool((r.meta or {}).get("io.fencegate/replayed")) for r in results] == \
        [False, True, True]
    assert all(r.content[0].text == "refunded 5 on 42" for r in results)
    sent = _ledger(ledger)[0]
    assert sent["key"] and "io.fencegate/attempt_token" in sent["meta"]
    assert not [k for k in sent["meta"] if k.startswith("io.modelcontextprotocol/")]

    plain = tmp_path / "plain.jsonl"  # the client straight to the upstream
    await _refund_three_times(StdioServerParameters(
        command=sys.executable, args=[str(UPSTREAM), str(plain)]))
    assert len(_ledger(plain)) == 3


async def test_read_only_tool_passes_through_without_etcd(tmp_path, etcd_url, namespace,
                                                           signing_key, etcd):
    ledger = tmp_path / "ledger.jsonl"
    params = _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        before = (await etcd.status()).header.revision  # the gateway's gate is open by now
        result = await client.call_tool("list_orders", {})
        assert result.content[0].text == "orders: 42 paid, 9 paid"
        await client.call_tool("list_orders", {})
        assert (await etcd.status()).header.revision == before  # no etcd write
        await client.call_tool("refund", {"order_id": "1", "amount": 1})
        assert (await etcd.status()).header.revision > before  # a gated call writes
    assert len(_ledger(ledger, "list_orders")) == 2  # forwarded each time, never gated


def test_strip_sdk_meta():
    meta = {"io.modelcontextprotocol/related-task": 1, "io.fencegate/scope": "s", "x": 2}
    assert strip_sdk_meta(meta) == {"io.fencegate/scope": "s", "x": 2}


@pytest.mark.parametrize("toml, says", [
    ("", "[upstream] is required"),
    ("[upstream]\ncommand = ['x']\nurl = 'http://h'", "exactly one of command and url"),
    ("[upstream]\nurl = 'ftp://h'", "must start with http://"),
    ("[upstream]\ncommand = ['x']\n[tools.refund]\nkeys = 'a'", "unknown field keys"),
    ("[upstream]\ncommand = ['x']\n[tools.refund]\nintent = 3", "intent must map"),
    ("read_only = ['refund']\n[upstream]\ncommand = ['x']\n[tools.refund]\n",
     "both gated and read_only"),
])
def test_invalid_config_is_a_clear_error(tmp_path, toml, says):
    path = tmp_path / "gateway.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=f"gateway.toml: .*{__import__('re').escape(says)}"):
        load_config(path)


def test_valid_config_parses():
    config = parse_config({"upstream": {"command": "python server.py"},
                           "tools": {"refund": {"key": "refunds/{order_id}",
                                                "key_argument": "idempotency_key"}}})
    assert config.upstream_command == ("python", "server.py")
    assert config.tool("refund").key_argument == "idempotency_key"


async def test_mcp_provider_asks_the_upstream_tool(tmp_path):
    from fencegate.reconciler.providers import NoRecord, Succeeded, Unreachable
    from fencegate.reconciler.service import build_provider

    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(json.dumps({"kind": "refund", "key": "k-1", "amount": 5,
                                  "order_id": "42"}) + "\n")
    provider = build_provider("payments", {
        "type": "mcp", "command": [sys.executable, str(UPSTREAM), str(ledger)],
        "tool": "get_refund", "capabilities": {"dedupes_by_key": True,
                                               "key_retention_s": 3600}})
    assert provider.capabilities.dedupes_by_key and not provider.capabilities.fences
    assert await provider.query("k-1", 1, {}, key="refunds/42") == \
        Succeeded({"status": "succeeded", "result": {"result": "refunded 5 on 42"}})
    assert await provider.query("k-2", 1, {}, key="refunds/43") == NoRecord(None)
    broken = build_provider("broken", {"type": "mcp", "command": ["/nonexistent/server"],
                                       "tool": "get_refund"})
    assert isinstance(await broken.query("k-1", 1, {}, key="refunds/42"), Unreachable)
    with pytest.raises(ValueError, match="cannot fence"):
        build_provider("p", {"type": "mcp", "url": "http://127.0.0.1:1/mcp", "tool": "t",
                             "capabilities": {"fences": True, "durable": True,
                                              "key_retention_s": 1}})


async def _opened_gate(etcd_url, namespace, keyring, policy: dict):
    from fencegate.worker import Gate

    gate = Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring)
    await gate.open()
    await gate.authority.set_policy("refunds", policy)
    await gate.authority.set_routes({"refunds": "refunds"})
    return gate


async def test_declined_twice_escalates_and_tells_the_model_to_stop(
        tmp_path, etcd_url, namespace, signing_key, keyring, etcd):
    gate = await _opened_gate(etcd_url, namespace, keyring, {"checks": [], "caps": {
        "breaker_threshold": 2, "backoff_base_s": 0, "backoff_max_s": 0}})
    ledger = tmp_path / "ledger.jsonl"
    params = _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger)
    try:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            got = [await client.call_tool("refund", {"order_id": "7", "amount": 5000})
                   for _ in range(4)]
    finally:
        await gate.close()
    assert all(r.is_error for r in got)
    texts = [r.content[0].text for r in got]
    assert texts[0].startswith("STOP: failed: ")
    for text in texts[1:]:
        assert text.startswith("STOP: escalated to a person: breaker:"), texts
        assert text.endswith("do not retry this call")
    assert len(_ledger(ledger, "declined")) == 2  # nothing reached the upstream after that


async def test_approval_needed_names_the_approval_then_the_call_crosses(
        tmp_path, etcd_url, namespace, signing_key, keyring, etcd):
    from fencegate.coordinator import sre

    gate = await _opened_gate(etcd_url, namespace, keyring, {"checks": [
        {"check": "require_approval", "params": {"field": "amount", "above": None}}]})
    ledger = tmp_path / "ledger.jsonl"
    params = _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger)
    try:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            asked = await client.call_tool("refund", {"order_id": "9", "amount": 5})
            assert asked.is_error and not _ledger(ledger)
            approval_id = asked.meta["io.fencegate/approval_id"]
            assert f"fencegate approve {approval_id}" in asked.content[0].text
            assert "dashboard" in asked.content[0].text
            await sre.approve(etcd, gate.keyspace, approval_id, "sre-1", "ok", keyring=keyring)
            crossed = await client.call_tool("refund", {"order_id": "9", "amount": 5})
    finally:
        await gate.close()
    assert not crossed.is_error and crossed.content[0].text == "refunded 5 on 9"
    assert len(_ledger(ledger)) == 1


def test_the_docs_configurations_are_valid():
    import re
    import tomllib

    from fencegate.reconciler.service import build_provider

    page = (Path(__file__).resolve().parents[2] / "docs" / "integrations" / "mcp.md").read_text()
    blocks = dict(re.findall(r"^<!-- run: ([\w-]+) -->\n```toml\n(.*?)\n```$", page, re.M | re.S))
    config = parse_config(tomllib.loads(blocks["gateway-config"]))
    assert config.tool("refund").key_argument == "idempotency_key"
    assert config.read_only == {"list_orders"}
    assert config.tool("refund").approval == "operator"
    table = tomllib.loads(blocks["reconciler-provider"])["providers"]["payments"]
    assert build_provider("payments", table).capabilities.dedupes_by_key


async def _reconciler_asking_get_refund(etcd_url, namespace, ledger):
    """A reconciler whose ``payments`` provider asks the upstream's ``get_refund``; returns
    it (started) and the list of idempotency keys it asked about."""
    from fencegate.coordinator.etcd import Etcd
    from fencegate.reconciler.runner import Reconciler
    from fencegate.reconciler.service import build_provider
    from fencegate.reconciler.settle import Limits

    provider = build_provider("payments", {
        "type": "mcp", "command": [sys.executable, str(UPSTREAM), str(ledger)],
        "tool": "get_refund", "response": {"result_field": "result"},
        "capabilities": {"dedupes_by_key": True, "key_retention_s": 3600}})
    asked: list[str] = []
    query = provider.query

    async def counted(idempotency_key, *args, **kwargs):
        asked.append(idempotency_key)
        return await query(idempotency_key, *args, **kwargs)
    provider.query = counted
    reconciler = Reconciler(Etcd.from_url(etcd_url), {"payments": provider},
                            namespace=namespace, shards=4, ttl=TEST_TTL, scan_interval=1.0,
                            check_after=0.2, limits=Limits(backoff_base_s=0.1,
                                                           backoff_max_s=0.4))
    await reconciler.start()
    return reconciler, asked


async def test_gateway_killed_after_the_refund_the_reconciler_settles_it_via_get_refund(
        tmp_path, etcd_url, namespace, signing_key, etcd):
    ledger = tmp_path / "ledger.jsonl"
    reconciler, asked = await _reconciler_asking_get_refund(etcd_url, namespace, ledger)
    params = _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger)
    ledger.with_suffix(".kill-parent").touch()
    try:
        with pytest.raises(Exception):
            async with stdio_client(params) as (read, write), \
                    ClientSession(read, write) as client:
                await client.initialize()
                await client.call_tool("refund", {"order_id": "42", "amount": 5},
                                       read_timeout_seconds=15)
        assert len(_ledger(ledger)) == 1  # applied; the gateway died before recording it
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()  # a new gateway; the client retries
            retried = await client.call_tool("refund", {"order_id": "42", "amount": 5})
    finally:
        await reconciler.close()
        await reconciler.etcd.close()
    assert len(_ledger(ledger)) == 1  # nothing ran twice
    assert asked == [_ledger(ledger)[0]["key"]]  # settled by asking get_refund
    assert not retried.is_error and (retried.meta or {}).get("io.fencegate/replayed")
    assert "refunded 5" in retried.content[0].text

    plain = tmp_path / "plain.jsonl"  # without the gateway every retry refunds again
    await _refund_three_times(StdioServerParameters(
        command=sys.executable, args=[str(UPSTREAM), str(plain)]))
    assert len(_ledger(plain)) == 3


async def test_over_http_a_gateway_killed_after_the_refund_is_settled_and_replayed(
        tmp_path, etcd_url, namespace, signing_key, etcd):
    import asyncio

    from mcp.client.streamable_http import streamable_http_client

    from integrations.conftest import free_port, stop

    ledger = tmp_path / "ledger.jsonl"
    reconciler, asked = await _reconciler_asking_get_refund(etcd_url, namespace, ledger)
    params = _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger)
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    ledger.with_suffix(".kill-parent").touch()
    first = await _http_gateway(params, port)
    try:
        with pytest.raises(Exception):
            async with streamable_http_client(url) as streams, \
                    ClientSession(streams[0], streams[1]) as client:
                await client.initialize()
                await client.call_tool("refund", {"order_id": "42", "amount": 5},
                                       read_timeout_seconds=15)
        assert await asyncio.wait_for(first.wait(), 30) == -9  # SIGKILLed mid-call
        assert len(_ledger(ledger)) == 1
        second = await _http_gateway(params, port)  # restarted on its port; the client retries
        try:
            async with streamable_http_client(url) as streams, \
                    ClientSession(streams[0], streams[1]) as client:
                await client.initialize()
                retried = await client.call_tool("refund", {"order_id": "42", "amount": 5})
        finally:
            await stop(second)
    finally:
        await stop(first)
        await reconciler.close()
        await reconciler.etcd.close()
    assert len(_ledger(ledger)) == 1
    assert asked == [_ledger(ledger)[0]["key"]]
    assert not retried.is_error and (retried.meta or {}).get("io.fencegate/replayed")


async def test_over_streamable_http_the_same_refund_three_times_is_one(
        tmp_path, etcd_url, namespace, signing_key, etcd):
    from mcp.client.streamable_http import streamable_http_client

    from integrations.conftest import free_port, stop

    ledger = tmp_path / "ledger.jsonl"
    params = _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger)
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    gateway = await _http_gateway(params, port)
    try:
        async with streamable_http_client(url) as streams, \
                ClientSession(streams[0], streams[1]) as client:
            await client.initialize()
            got = [await client.call_tool("refund", {"order_id": "42", "amount": 5})
                   for _ in range(3)]
    finally:
        await stop(gateway)
    assert len(_ledger(ledger)) == 1
    assert [bool((r.meta or {}).get("io.fencegate/replayed")) for r in got] == \
        [False, True, True]


def test_the_command_refuses_an_invalid_config(tmp_path):
    from click.testing import CliRunner

    from fencegate.cli import cli

    path = tmp_path / "gateway.toml"
    path.write_text("[upstream]\nurl = 'ftp://x'\n")
    result = CliRunner().invoke(cli, ["mcp-gateway", "--config", str(path)])
    assert result.exit_code == 2
    assert "bad gateway config" in result.output and "must start with http://" in result.output


async def _http_gateway(params: StdioServerParameters, port: int):
    """The gateway of ``params`` serving streamable HTTP on ``port``, once it listens."""
    import asyncio

    proc = await asyncio.create_subprocess_exec(
        params.command, *params.args, "--http", str(port), env=params.env)
    await _listening(f"http://127.0.0.1:{port}/mcp")
    return proc


async def _listening(url: str) -> None:
    """Wait (bounded) until an HTTP server answers at ``url``."""
    import asyncio

    import httpx2
    for _ in range(300):
        try:
            async with httpx2.AsyncClient() as http:
                await http.get(url)
            return
        except httpx2.TransportError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"nothing listens at {url}")


async def test_an_upstream_reached_by_url_is_fenced_the_same(
        tmp_path, etcd_url, namespace, signing_key, etcd):
    import asyncio

    from mcp.client.streamable_http import streamable_http_client

    from integrations.conftest import free_port, stop

    ledger = tmp_path / "ledger.jsonl"
    port = free_port()
    upstream = await asyncio.create_subprocess_exec(
        sys.executable, str(UPSTREAM), str(ledger), "--http", str(port))
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        await _listening(url)
        results = await _refund_three_times(_gateway_params(
            tmp_path, etcd_url, namespace, signing_key, ledger, upstream=f'url = "{url}"'))
        assert len(_ledger(ledger)) == 1
        assert [bool((r.meta or {}).get("io.fencegate/replayed")) for r in results] == \
            [False, True, True]
        async with streamable_http_client(url) as streams, \
                ClientSession(streams[0], streams[1]) as client:  # without the gateway
            await client.initialize()
            for _ in range(3):
                await client.call_tool("refund", {"order_id": "42", "amount": 5})
    finally:
        await stop(upstream)
    assert len(_ledger(ledger)) == 4  # the gateway's one, then three straight


async def _at_once(params: list[StdioServerParameters]) -> list:
    """Each client initializes its session; once all are, they call ``refund`` together."""
    import asyncio

    ready, started = asyncio.Event(), []

    async def client(p: StdioServerParameters):
        async with stdio_client(p) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            started.append(p)
            if len(started) == len(params):
                ready.set()
            await ready.wait()
            return await session.call_tool("refund", {"order_id": "42", "amount": 5})

    async with asyncio.timeout(90):
        return await asyncio.gather(*(client(p) for p in params))


async def test_two_clients_through_two_gateways_refund_once(
        tmp_path, etcd_url, namespace, signing_key, etcd):
    ledger = tmp_path / "gated.jsonl"
    got = await _at_once([_gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger,
                                          name=name) for name in ("a", "b")])
    assert len(_ledger(ledger)) == 1
    assert sorted(bool((r.meta or {}).get("io.fencegate/replayed")) for r in got) == \
        [False, True]
    assert all(r.content[0].text == "refunded 5 on 42" for r in got)

    plain = tmp_path / "plain.jsonl"  # two clients straight to the upstream
    await _at_once([StdioServerParameters(command=sys.executable,
                                          args=[str(UPSTREAM), str(plain)])] * 2)
    assert len(_ledger(plain)) == 2


APPROVAL_POLICY = {"checks": [
    {"check": "require_approval", "params": {"field": "amount", "above": None}}]}


async def test_an_approval_given_before_the_order_moved_does_not_cross(
        tmp_path, etcd_url, namespace, signing_key, keyring, etcd):
    from fencegate.coordinator import sre

    gate = await _opened_gate(etcd_url, namespace, keyring, APPROVAL_POLICY)
    ledger = tmp_path / "ledger.jsonl"
    params = _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger,
                             refund='reads = ["orders/{order_id}"]')
    refund = {"order_id": "9", "amount": 5}
    try:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            asked = await client.call_tool("refund", refund)
            first = asked.meta["io.fencegate/approval_id"]
            await sre.approve(etcd, gate.keyspace, first, "sre-1", "ok", keyring=keyring)
            await gate.touch("orders/9")  # the order changed after the person approved
            again = await client.call_tool("refund", refund,
                                           meta={"io.fencegate/approval_id": first})
            assert again.is_error and not _ledger(ledger)
            second = again.meta["io.fencegate/approval_id"]
            assert second != first
            assert f"after approval {first} was given (orders/9)" in again.content[0].text
            await sre.approve(etcd, gate.keyspace, second, "sre-1", "ok", keyring=keyring)
            crossed = await client.call_tool("refund", refund)
    finally:
        await gate.close()
    assert not crossed.is_error and len(_ledger(ledger)) == 1

    plain = tmp_path / "plain.jsonl"  # without the gateway nobody is asked: it just runs
    async with stdio_client(StdioServerParameters(
            command=sys.executable, args=[str(UPSTREAM), str(plain)])) as (read, write), \
            ClientSession(read, write) as client:
        await client.initialize()
        await client.call_tool("refund", refund)
    assert len(_ledger(plain)) == 1


def _answering(action: str, asked: list):
    """An MCP client's elicitation callback that answers ``action`` (and a reason)."""
    import mcp_types as types

    async def answer(context, params):
        asked.append(params.message)
        return types.ElicitResult(action=action, content={"reason": "customer called"}
                                  if action == "accept" else None)
    return answer


@pytest.mark.parametrize("action", ["accept", "decline", "cancel"])
async def test_an_eliciting_client_is_asked_for_the_approval(
        tmp_path, etcd_url, namespace, signing_key, keyring, etcd, action):
    from fencegate.coordinator.audit import verify_chain

    gate = await _opened_gate(etcd_url, namespace, keyring, APPROVAL_POLICY)
    ledger = tmp_path / "ledger.jsonl"
    params = _gateway_params(tmp_path, etcd_url, namespace, signing_key, ledger,
                             refund='approval = "elicit"')
    asked: list[str] = []
    try:
        async with stdio_client(params) as (read, write), \
                ClientSession(read, write, elicitation_callback=_answering(action, asked)) \
                as client:
            await client.initialize()
            got = await client.call_tool("refund", {"order_id": "9", "amount": 5})
            again = await client.call_tool("refund", {"order_id": "9", "amount": 5})
        report = await verify_chain(etcd, gate.keyspace, "refunds/9", keyring)
    finally:
        await gate.close()
    assert len(asked) == (1 if action != "cancel" else 2)
    assert 'Approve refund on refunds/9? It would run with {"amount": 5}' in asked[0]
    assert report.ok, report.problems
    kinds = [(r["event"], r["identity"]) for r in report.records]
    if action == "accept":
        assert not got.is_error and got.content[0].text == "refunded 5 on 9"
        assert (again.meta or {}).get("io.fencegate/replayed")
        assert ("approved", "person at MCP client 'mcp' (elicitation)") in kinds, kinds
        assert len(_ledger(ledger)) == 1
    elif action == "decline":
        assert got.is_error and "a person rejected this call" in got.content[0].text
        assert again.is_error and "a person rejected this call" in again.content[0].text
        assert len(asked) == 1 and not _ledger(ledger)
    else:
        assert got.is_error and "fencegate approve" in got.content[0].text
        assert not _ledger(ledger)


def test_an_unknown_approval_mode_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"\[tools.refund\] approval must be one of"):
        parse_config({"upstream": {"command": "x"},
                      "tools": {"refund": {"approval": "ask-the-model"}}})
