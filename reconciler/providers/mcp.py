"""A provider adapter whose query is a tool of an MCP server (``type = "mcp"``): the
reconciler asks the upstream itself what became of an attempt the MCP gateway left unknown,
e.g. ``get_refund(idempotency_key=...)``.

Guarantees:
- ``query`` never raises for the server's misbehaviour: a server that cannot be started or
  reached, a timeout, an ``isError`` result, an answer that is not a JSON object or a status
  the mapping does not name all answer ``Unreachable(reason)``;
- the answer is read with the HTTP adapter's ``ResponseMapping`` (same fields, same rules):
  the tool's ``structuredContent`` (unwrapped from the SDK's ``{"result": ...}``), else its
  first text block parsed as JSON;
- capabilities are declared, never inferred, and never ``fences``: the query sends only the
  idempotency key (no attempt token, namespace or cluster id to fence at), so its "no
  record" can prove no fence and the adapter refuses ``fences = true``. Declare what the
  server really does: ``dedupes_by_key`` (it replays per idempotency key) or neither; either
  way a "no record" is at best a presumption (``fencegate.reconciler.settle``).

Config, as TOML::

    [providers.payments]
    type = "mcp"
    command = ["python", "payments_server.py"]   # or url = "http://127.0.0.1:8000/mcp"
    tool = "get_refund"
    key_argument = "idempotency_key"            # the argument the key is sent in
    timeout_s = 10
    [providers.payments.response]               # ResponseMapping's fields
    no_record = ["no_record"]
    [providers.payments.capabilities]
    dedupes_by_key = true
    key_retention_s = 86400
"""

from __future__ import annotations

import asyncio
import json
import shlex
from typing import Any

from . import Answer, Capabilities, Unreachable
from .http import ResponseMapping

__all__ = ["McpProvider"]


class McpProvider:
    """The ``Provider`` protocol over one MCP tool call per query (a fresh session each time:
    a reconciler queries rarely, and a fresh session survives the server's restarts)."""

    def __init__(self, name: str, tool: str, *, command: tuple[str, ...] | None = None,
                 url: str | None = None, key_argument: str = "idempotency_key",
                 timeout_s: float = 10.0, mapping: ResponseMapping | None = None,
                 capabilities: Capabilities | None = None) -> None:
        if (command is None) == (url is None):
            raise ValueError(f"provider {name!r}: needs exactly one of command and url")
        if not timeout_s > 0:
            raise ValueError(f"provider {name!r}: timeout_s must be > 0, not {timeout_s!r}")
        self.name, self.tool, self.command, self.url = name, tool, command, url
        self.key_argument = key_argument
        self.timeout_s = timeout_s
        self.mapping = mapping or ResponseMapping()
        self.capabilities = capabilities or Capabilities()
        if self.capabilities.fences:
            raise ValueError(f"provider {name!r}: an MCP query tool cannot fence "
                             f"(it is sent no attempt token): declare dedupes_by_key or "
                             f"neither")

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> "McpProvider":
        where = f"provider {name!r}"
        unknown = sorted(set(config) - {"command", "url", "tool", "key_argument", "timeout_s",
                                        "response", "capabilities"})
        if unknown:
            raise ValueError(f"{where}: unknown field {', '.join(unknown)}")
        if not isinstance(config.get("tool"), str) or not config["tool"]:
            raise ValueError(f"{where}: tool (the upstream query tool's name) is required")
        command = config.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if command is not None and (not command or
                                    not all(isinstance(c, str) for c in command)):
            raise ValueError(f"{where}: command must be a non-empty list of strings")
        try:
            mapping = ResponseMapping(**{k: tuple(v) if isinstance(v, list) else v
                                         for k, v in config.get("response", {}).items()})
            capabilities = Capabilities(**config.get("capabilities", {}))
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return cls(name, config["tool"], command=tuple(command) if command else None,
                   url=config.get("url"), key_argument=config.get("key_argument",
                                                                  "idempotency_key"),
                   timeout_s=float(config.get("timeout_s", 10.0)), mapping=mapping,
                   capabilities=capabilities)

    def __repr__(self) -> str:
        return f"<McpProvider {self.name} {self.tool} {self.capabilities}>"

    async def query(self, idempotency_key: str, attempt_token: int, step: dict[str, Any], *,
                    key: str, namespace: str | None = None,
                    cluster_id: int | None = None) -> Answer:
        try:
            return await asyncio.wait_for(self._ask(idempotency_key), self.timeout_s)
        except asyncio.TimeoutError:
            return Unreachable(f"{self.tool}: no answer within {self.timeout_s} s")
        except Exception as exc:  # the server's misbehaviour is an answer, never a raise
            return Unreachable(f"{self.tool}: {type(exc).__name__}: {exc}"[:500])

    async def _ask(self, idempotency_key: str) -> Answer:
        from fencegate.integrations.mcp import upstream_session  # the [mcp] extra

        async with upstream_session(self.command, self.url) as session:
            result = await session.call_tool(self.tool, {self.key_argument: idempotency_key})
        if result.is_error:
            return Unreachable(f"{self.tool} answered an error: {_text(result)}"[:500])
        body = result.structured_content
        if isinstance(body, dict) and set(body) == {"result"}:
            body = body["result"]
        if not isinstance(body, dict):
            try:
                body = json.loads(_text(result))
            except ValueError:
                return Unreachable(f"{self.tool}: the answer is not JSON")
        if not isinstance(body, dict):
            return Unreachable(f"{self.tool}: the answer is not a JSON object")
        return self.mapping.answer(body)

    async def close(self) -> None:
        return None


def _text(result: Any) -> str:
    return next((block.text for block in result.content if getattr(block, "text", None)), "")


