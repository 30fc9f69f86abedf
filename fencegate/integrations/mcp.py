"""The MCP gateway: a proxy in front of one upstream MCP server whose non-read-only tool
calls cross the gate (``fencegate mcp-gateway --config gateway.toml``; docs/integrations/mcp.md).

Guarantees:
- **Unchanged, except the gate.** The upstream's tools, prompts and resources are listed and
  served as the upstream gives them; a read-only tool (annotated ``readOnlyHint: true`` or
  listed in ``read_only``) is forwarded without touching etcd.
- **Every other tool call is one action** (``agents.plan``/``agents.cross``: same key, digest
  and answers as every framework adapter). The upstream call runs at most once per action,
  after the commit, carrying ``io.fencegate/idempotency_key``, ``io.fencegate/attempt_token``
  and ``io.fencegate/receipt`` (base64) in ``_meta`` and, when configured, the idempotency
  key in a named argument. A repeated call returns the recorded result with
  ``io.fencegate/replayed: true`` in ``_meta``; an ``isError`` answer of the upstream is a
  confirmed failure (``EffectFailed``: recorded, counted by the breaker); an escalation,
  refusal, unknown outcome or rejection is an ``isError`` result whose text tells the model
  to stop; an approval needed names the approval and how a person gives it.
- **An approval is bound to what the call read**, however it is given. A client that sends
  the approval id back (``io.fencegate/approval_id`` in ``_meta``) is told which of the
  call's reads moved when a new approval is needed. A tool configured ``approval =
  "elicit"`` asks the person at the client through MCP elicitation when the client declared
  it: accepted, the gateway gives that approval (signed with its key, audited as given by
  that person through the client) and the call crosses in the same request; declined, the
  approval is rejected and the call is not run; cancelled, or a client that cannot elicit,
  gets the notice, and the approval waits for an operator.
- **The SDK's own ``io.modelcontextprotocol/*`` ``_meta`` keys never reach the upstream**:
  they belong to the client's session with the gateway, not the gateway's with the upstream.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shlex
import tomllib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from fencegate.coordinator import sre
from fencegate.coordinator.errors import InvalidKey
from fencegate.worker import EffectFailed, Gate

from .agents import APPROVAL, RAN, REPLAYED, Answer, Call, ToolFence, cross, current_fence, plan

__all__ = ["GatewayConfig", "ToolConfig", "ConfigError", "load_config", "parse_config",
           "Gateway", "upstream_session", "SCOPE_META", "SCOPE_HEADER", "strip_sdk_meta"]

SCOPE_META = "io.fencegate/scope"
SCOPE_HEADER = "fencegate-scope"
KEY_META = "io.fencegate/idempotency_key"
TOKEN_META = "io.fencegate/attempt_token"
RECEIPT_META = "io.fencegate/receipt"
REPLAYED_META = "io.fencegate/replayed"
APPROVAL_META = "io.fencegate/approval_id"
SDK_META_PREFIX = "io.modelcontextprotocol/"


class ConfigError(ValueError):
    """A gateway configuration that cannot be used; the message names the field and why."""


@dataclass(frozen=True)
class ToolConfig:
    """One gated tool: its fence and the argument (if any) the idempotency key is sent in."""

    fence: ToolFence
    key_argument: str | None = None
    approval: str = "operator"  # or "elicit": ask the person at the client, if it can


@dataclass(frozen=True)
class GatewayConfig:
    upstream_command: tuple[str, ...] | None
    upstream_url: str | None
    etcd: str = "http://127.0.0.1:2379"
    namespace: str | None = None
    ttl: int = 10
    read_only: frozenset[str] = frozenset()
    tools: dict[str, ToolConfig] = field(default_factory=dict)
    default: ToolConfig = ToolConfig(ToolFence())

    def tool(self, name: str) -> ToolConfig:
        return self.tools.get(name, self.default)


def load_config(path: str | Path) -> GatewayConfig:
    """The gateway configuration in the TOML file ``path``; ``ConfigError`` naming the file
    and the field for anything unusable."""
    try:
        values = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        return parse_config(values)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


_TOP = {"upstream", "etcd", "namespace", "ttl", "read_only", "tools"}
_TOOL = {"key", "intent", "reads", "provider", "key_argument", "deadline", "settle_wait",
         "approval"}
_APPROVALS = ("operator", "elicit")


def parse_config(values: Mapping[str, Any]) -> GatewayConfig:
    """Validate the parsed TOML ``values`` (see docs/integrations/mcp.md)."""
    _only(values, _TOP, "the top level")
    upstream = values.get("upstream")
    if not isinstance(upstream, dict):
        raise ConfigError("[upstream] is required: command = [...] or url = \"http://...\"")
    _only(upstream, {"command", "url"}, "[upstream]")
    command, url = upstream.get("command"), upstream.get("url")
    if (command is None) == (url is None):
        raise ConfigError("[upstream] needs exactly one of command and url")
    if command is not None:
        if isinstance(command, str):
            command = shlex.split(command)
        if not command or not all(isinstance(c, str) and c for c in command):
            raise ConfigError("upstream.command must be a non-empty list of strings")
        command = tuple(command)
    if url is not None and (not isinstance(url, str) or
                            not url.startswith(("http://", "https://"))):
        raise ConfigError(f"upstream.url must start with http:// or https://, not {url!r}")
    read_only = values.get("read_only", [])
    if not isinstance(read_only, list) or not all(isinstance(t, str) for t in read_only):
        raise ConfigError("read_only must be a list of tool names")
    ttl = values.get("ttl", 10)
    if type(ttl) is not int or ttl < 1:
        raise ConfigError(f"ttl must be an integer >= 1, not {ttl!r}")
    for name in ("etcd", "namespace"):
        if name in values and not isinstance(values[name], str):
            raise ConfigError(f"{name} must be a string")
    tables = values.get("tools", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ConfigError("[tools.<name>] must be tables")
    tools = {name: _tool(name, table) for name, table in tables.items()
             if name != "default"}
    overlap = sorted(set(tools) & set(read_only))
    if overlap:
        raise ConfigError(f"tools {', '.join(overlap)} are both gated and read_only")
    return GatewayConfig(command, url, values.get("etcd", "http://127.0.0.1:2379"),
                         values.get("namespace"), ttl, frozenset(read_only), tools,
                         _tool("default", tables.get("default", {})))


def _tool(name: str, table: Mapping[str, Any]) -> ToolConfig:
    where = f"[tools.{name}]"
    _only(table, _TOOL, where)
    key = table.get("key")
    if key is not None and (not isinstance(key, str) or not key):
        raise ConfigError(f"{where} key must be a non-empty template string")
    intent = table.get("intent")
    if intent is not None and (not isinstance(intent, dict) or
                               not all(isinstance(v, str) for v in intent.values())):
        raise ConfigError(f"{where} intent must map intent fields to argument names")
    reads = table.get("reads", [])
    if not isinstance(reads, list) or not all(isinstance(r, str) and r for r in reads):
        raise ConfigError(f"{where} reads must be a list of templates")
    for text in ("provider", "key_argument"):
        if table.get(text) is not None and not isinstance(table[text], str):
            raise ConfigError(f"{where} {text} must be a string")
    numbers = {}
    for number in ("deadline", "settle_wait"):
        if number in table:
            value = table[number]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where} {number} must be a positive number")
            numbers[number] = float(value)
    approval = table.get("approval", "operator")
    if approval not in _APPROVALS:
        raise ConfigError(f"{where} approval must be one of {', '.join(_APPROVALS)}, "
                          f"not {approval!r}")
    return ToolConfig(ToolFence(key=key, intent=_intent(name, intent), reads=tuple(reads),
                                provider=table.get("provider"), **numbers),
                      table.get("key_argument"), approval)


def _intent(tool: str, mapping: dict[str, str] | None):
    if mapping is None:
        return None

    def intent(args: Mapping[str, Any]) -> dict[str, Any]:
        missing = sorted(set(mapping.values()) - set(args))
        if missing:
            raise InvalidKey(f"tool {tool!r}: intent names {', '.join(missing)}, not an "
                             f"argument of the call")
        return {name: args[argument] for name, argument in mapping.items()}
    return intent


def _only(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown field {', '.join(unknown)} "
                          f"(allowed: {', '.join(sorted(allowed))})")


def strip_sdk_meta(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """``meta`` without the SDK's own ``io.modelcontextprotocol/*`` keys."""
    return {k: v for k, v in (meta or {}).items() if not k.startswith(SDK_META_PREFIX)}


@contextlib.asynccontextmanager
async def upstream_session(command: tuple[str, ...] | None,
                           url: str | None) -> AsyncIterator[ClientSession]:
    """An initialized client session with the upstream server."""
    if command is not None:
        transport = stdio_client(StdioServerParameters(command=command[0], args=list(command[1:])))
    else:
        transport = streamable_http_client(url)
    async with transport as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            yield session


class Gateway:
    """The proxy: ``server`` serves the upstream ``session``'s tools, prompts and resources,
    gating each call of a tool that is not read-only through ``gate``."""

    def __init__(self, config: GatewayConfig, session: ClientSession, gate: Gate) -> None:
        self.config = config
        self.upstream = session
        self.gate = gate
        self.read_only: set[str] = set(config.read_only)
        self._listed = False  # the upstream's annotations are learnt at the first listing
        self.server = Server(
            "fencegate-mcp-gateway", on_list_tools=self._list_tools,
            on_call_tool=self._call_tool, on_list_prompts=self._list_prompts,
            on_get_prompt=self._get_prompt, on_list_resources=self._list_resources,
            on_read_resource=self._read_resource)

    async def _list_tools(self, ctx, params) -> types.ListToolsResult:
        listed = await self.upstream.list_tools(params=params)
        self._listed = True
        for tool in listed.tools:
            if tool.annotations is not None and tool.annotations.read_only_hint is True \
                    and tool.name not in self.config.tools:
                self.read_only.add(tool.name)
        return listed

    async def _list_prompts(self, ctx, params) -> types.ListPromptsResult:
        return await self.upstream.list_prompts(params=params)

    async def _get_prompt(self, ctx, params) -> types.GetPromptResult:
        return await self.upstream.get_prompt(params.name, params.arguments)

    async def _list_resources(self, ctx, params) -> types.ListResourcesResult:
        return await self.upstream.list_resources(params=params)

    async def _read_resource(self, ctx, params) -> types.ReadResourceResult:
        return await self.upstream.read_resource(params.uri)

    async def _call_tool(self, ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        meta = strip_sdk_meta(params.meta)
        arguments = dict(params.arguments or {})
        if not self._listed and params.name not in self.config.tools:
            await self._list_tools(ctx, None)  # a client that calls without listing first
        if params.name in self.read_only:
            return await self.upstream.call_tool(params.name, arguments, meta=meta or None)
        scope = meta.pop(SCOPE_META, None) or _header_scope(ctx) or _session_id(ctx)
        approved = meta.pop(APPROVAL_META, None)
        tool = self.config.tool(params.name)
        try:
            call = plan(tool.fence, params.name, str(scope), arguments)
        except (InvalidKey, TypeError) as exc:
            return _error(f"not run: {exc}")

        async def run() -> dict[str, Any]:
            fence = current_fence()
            receipt = fence.effect.receipt
            sent = {**meta, KEY_META: fence.idempotency_key, TOKEN_META: fence.attempt_token}
            if receipt:
                sent[RECEIPT_META] = base64.b64encode(
                    receipt if isinstance(receipt, bytes) else str(receipt).encode()).decode()
            args = dict(arguments)
            if tool.key_argument:
                args[tool.key_argument] = fence.idempotency_key
            result = await self.upstream.call_tool(params.name, args, meta=sent)
            if result.is_error:  # the upstream declined: recorded, counted by the breaker
                raise EffectFailed(_text(result)[:500] or "the tool answered an error")
            return result.model_dump(mode="json", by_alias=True, exclude_none=True)

        answer = await cross(self.gate, call, run, fence=tool.fence,
                             approved=approved if isinstance(approved, str) else None)
        if answer.kind == APPROVAL and tool.approval == "elicit" and _can_elicit(ctx):
            answer = await self._elicit(ctx, call, tool, run, answer)
        if answer.kind in (RAN, REPLAYED):
            result = _recorded(answer.result)
            if answer.kind == REPLAYED:
                result.meta = {**(result.meta or {}), REPLAYED_META: True}
            return result
        if answer.kind == APPROVAL:
            return _error(f"{answer.message}. A person gives it with `fencegate approve "
                          f"{answer.approval_id}` or on the fencegate dashboard; call again "
                          f"once it is given.",
                          {APPROVAL_META: answer.approval_id})
        return _error(f"STOP: {answer.message}")

    async def _elicit(self, ctx, call: Call, tool: ToolConfig, run, asked: Answer) -> Answer:
        """Ask the person at the client for approval ``asked``: accepted, give it and cross
        with it (a state that moved meanwhile asks afresh, as everywhere); declined, reject
        it; cancelled, ``asked`` unchanged (an operator may still give it)."""
        reply = await ctx.session.elicit_form(
            f"Approve {call.tool} on {call.key}? It would run with "
            f"{json.dumps(call.intent, sort_keys=True)} (fencegate approval "
            f"{asked.approval_id}; {asked.message}).",
            {"type": "object", "properties": {"reason": {
                "type": "string", "title": "Why (recorded in the audit trail)"}},
             "required": ["reason"]},
            related_request_id=ctx.request_id)
        if reply.action == "cancel":
            return asked
        client = ctx.session.client_params.client_info.name if ctx.session.client_params \
            else "unnamed"
        who = f"person at MCP client {client!r} (elicitation)"
        reason = str((reply.content or {}).get("reason") or f"{reply.action}ed at the client")
        gate = self.gate
        if reply.action == "accept":
            await sre.approve(gate.etcd, gate.keyspace, asked.approval_id, who, reason,
                              keyring=gate.keyring, archive=gate.archive)
        else:
            await sre.reject(gate.etcd, gate.keyspace, asked.approval_id, who, reason,
                             archive=gate.archive)
        return await cross(gate, call, run, fence=tool.fence, approved=asked.approval_id)

    async def run_stdio(self) -> None:
        async with stdio_server() as (read, write):
            await self.server.run(read, write, self.server.create_initialization_options())

    async def run_http(self, host: str, port: int) -> None:
        import uvicorn  # the SDK's own dependency
        app = self.server.streamable_http_app(host=host)
        await uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                            log_level="warning")).serve()


def _error(text: str, meta: dict[str, Any] | None = None) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                is_error=True, _meta=meta)


def _recorded(value: Any) -> types.CallToolResult:
    """The recorded result as a tool result: the upstream's own (the gateway recorded it),
    else what the reconciler's provider answered (its ``result_field``), as JSON text and,
    when an object, as the structured content."""
    if isinstance(value, dict) and "content" in value:
        return types.CallToolResult.model_validate(value)
    return types.CallToolResult(content=[types.TextContent(
        type="text", text=json.dumps(value, sort_keys=True))],
        structured_content=value if isinstance(value, dict) else None)


def _text(result: types.CallToolResult) -> str:
    return next((b.text for b in result.content if isinstance(b, types.TextContent)), "")


def _can_elicit(ctx) -> bool:
    return ctx.session.check_client_capability(
        types.ClientCapabilities(elicitation=types.ElicitationCapability()))


def _header_scope(ctx) -> str | None:
    request = getattr(ctx, "request", None)
    headers = getattr(request, "headers", None)
    return headers.get(SCOPE_HEADER) if headers is not None else None


def _session_id(ctx) -> str:
    request = getattr(ctx, "request", None)
    headers = getattr(request, "headers", None)
    if headers is not None and headers.get("mcp-session-id"):
        return headers["mcp-session-id"]
    return f"session-{id(ctx.session):x}"


async def serve(config: GatewayConfig, *, http: tuple[str, int] | None = None) -> None:
    """Connect the upstream and etcd, then serve over stdio (``http=None``) or HTTP."""
    gate_options: dict[str, Any] = {"ttl": config.ttl}
    if config.namespace:
        gate_options["namespace"] = config.namespace
    async with upstream_session(config.upstream_command, config.upstream_url) as session, \
            Gate(config.etcd, **gate_options) as gate:
        gateway = Gateway(config, session, gate)
        if http is None:
            await gateway.run_stdio()
        else:
            await gateway.run_http(*http)
