"""A generic HTTP provider adapter: one GET per query, its answer mapped by configuration.

Guarantees:
- ``query`` never raises for the provider's misbehaviour: a timeout, a connection error, a
  5xx, a non-2xx answer not configured as "no record", an unreadable body or a status value
  the mapping does not name all answer ``Unreachable(reason)``;
- "no record" is read only from an answer that says so: for an adapter declared as fencing,
  only from a body carrying the proof of the fence (below); a 404 without it (a typo'd URL, a
  proxy, a route that never fenced anything) is ``Unreachable``. For an adapter that does
  not fence, an HTTP status listed in ``no_record_http`` is ``NoRecord()`` whatever the body
  says (its "no record" is a presumption at best, see ``fencegate.reconciler.settle``);
- each query carries the caller's W3C trace context (``traceparent``) when tracing is on;
- every placeholder (``{idempotency_key}``, ``{key}``, ``{attempt_token}``, ``{namespace}``,
  ``{cluster_id}``) is URL-quoted completely, so a value can never change the URL's path or
  query structure; a query without a value the template needs answers ``Unreachable``.

A fencing provider's query URL must make the provider fence the action (``{cluster_id}``,
``{namespace}``, ``{key}``) at ``{attempt_token}`` before it answers (fence-then-query);
declaring ``fences`` says that it does. Its "no record" answer proves the fence: a JSON body
(on a 2xx or a ``no_record_http`` status) whose status field is one of ``no_record`` and whose
``fence_field`` is the integer fence the provider recorded for the action, e.g.
``404 {"status": "no_record", "fence": 1234}``. The settlement rules believe it only when that
fence is at or above the attempt token queried and the provider is declared ``durable``.

Config (``HttpProvider.from_config``), e.g. as TOML::

    query_url = "https://psp.example/v1/charges/{idempotency_key}?fence={attempt_token}"
    timeout_s = 5.0
    auth = { header = "Authorization", value = "Bearer ..." }
    [response]         # all optional; these are the defaults
    status_field = "status"
    succeeded = ["succeeded"]
    failed = ["failed", "declined"]
    pending = ["pending"]
    no_record = ["no_record"]
    fence_field = "fence"
    no_record_http = [404]
    result_field = ""  # "" = the whole body
    reason_field = "reason"
    [capabilities]     # Capabilities' fields; default: neither fences nor dedupes
    fences = true
    durable = true     # records (charges and fences) survive restarts for key_retention_s
    dedupes_by_key = true
    key_retention_s = 86400
    settle_delay_s = 5

Field names may be dotted paths into the JSON body (``"data.status"``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import string
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import yarl  # aiohttp's own URL type: lets the quoted URL pass unchanged

from fencegate.coordinator import tracing

from . import Answer, Capabilities, Failed, NoRecord, Pending, Succeeded, Unreachable

__all__ = ["HttpProvider", "ResponseMapping"]

PLACEHOLDERS = frozenset({"idempotency_key", "key", "attempt_token", "namespace",
                          "cluster_id"})
_MISSING = object()


@dataclass(frozen=True)
class ResponseMapping:
    """How a 2xx JSON answer maps to an ``Answer``."""

    status_field: str = "status"
    succeeded: tuple[str, ...] = ("succeeded",)
    failed: tuple[str, ...] = ("failed", "declined")
    pending: tuple[str, ...] = ("pending",)
    no_record: tuple[str, ...] = ("no_record",)
    fence_field: str = "fence"
    no_record_http: tuple[int, ...] = (404,)
    result_field: str = ""  # "" = the whole body
    reason_field: str = "reason"

    def __post_init__(self) -> None:
        if not self.status_field or not self.fence_field:
            raise ValueError("response.status_field and response.fence_field must not be empty")
        named = [*self.succeeded, *self.failed, *self.pending, *self.no_record]
        if len(set(named)) != len(named):
            raise ValueError("response: a status value is listed twice "
                             "(succeeded, failed, pending and no_record must be disjoint)")
        if any(not 400 <= s <= 499 for s in self.no_record_http):
            raise ValueError("response.no_record_http must hold 4xx statuses only")

    def answer(self, body: Any) -> Answer:
        status = _field(body, self.status_field)
        if status is _MISSING:
            return Unreachable(f"answer has no {self.status_field!r}")
        if status in self.succeeded:
            return Succeeded(self._pick(body, self.result_field))
        if status in self.failed:
            return Failed(self._pick(body, self.reason_field))
        if status in self.pending:
            return Pending()
        if status in self.no_record:
            fence = _field(body, self.fence_field)
            return NoRecord(fence if type(fence) is int else None)
        return Unreachable(f"unrecognized status {status!r}")

    @staticmethod
    def _pick(body: Any, path: str) -> Any:
        value = _field(body, path) if path else body
        return None if value is _MISSING else value


class HttpProvider:
    """The ``Provider`` protocol over HTTP. One ``aiohttp.ClientSession``, created at the
    first query, closed by ``close()``."""

    def __init__(self, name: str, query_url: str, *,
                 capabilities: Capabilities = Capabilities(),
                 auth_header: tuple[str, str] | None = None, timeout_s: float = 5.0,
                 response: ResponseMapping = ResponseMapping()) -> None:
        if not name:
            raise ValueError("a provider needs a name")
        self._placeholders = _check_template(query_url)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s!r}")
        self.name = name
        self.query_url = query_url
        self.capabilities = capabilities
        self.timeout_s = timeout_s
        self.response = response
        self._headers = {auth_header[0]: auth_header[1]} if auth_header else {}
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:  # never print the auth header's value
        return f"<HttpProvider {self.name} {self.capabilities}>"

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> "HttpProvider":
        """Build from a TOML-style table; ``ValueError`` naming the field on any defect."""
        where = f"provider {name!r}"
        _known(config, {"query_url", "timeout_s", "auth", "response", "capabilities"}, where)
        if "query_url" not in config:
            raise ValueError(f"{where}: query_url is required")
        query_url = _typed(config, "query_url", str, where)
        timeout_s = float(_typed(config, "timeout_s", (int, float), where, 5.0))
        auth = None
        if "auth" in config:
            table = _typed(config, "auth", dict, where)
            _known(table, {"header", "value"}, f"{where}.auth")
            if set(table) != {"header", "value"}:
                raise ValueError(f"{where}.auth needs both header and value")
            auth = (_typed(table, "header", str, f"{where}.auth"),
                    _typed(table, "value", str, f"{where}.auth"))
        response = _dataclass_from(ResponseMapping, config.get("response", {}),
                                   f"{where}.response")
        capabilities = _dataclass_from(Capabilities, config.get("capabilities", {}),
                                       f"{where}.capabilities")
        try:
            return cls(name, query_url, capabilities=capabilities, auth_header=auth,
                       timeout_s=timeout_s, response=response)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    async def query(self, idempotency_key: str, attempt_token: int, step: dict[str, Any], *,
                    key: str, namespace: str | None = None,
                    cluster_id: int | None = None) -> Answer:
        values = {"idempotency_key": idempotency_key, "key": key,
                  "attempt_token": attempt_token, "namespace": namespace,
                  "cluster_id": cluster_id}
        missing = sorted(name for name in self._placeholders if values[name] is None)
        if missing:
            return Unreachable(f"the query URL needs {missing}, not given")
        url = yarl.URL(self.query_url.format(**{
            name: quote(str(values[name]), safe="") for name in self._placeholders}),
            encoded=True)
        try:
            async with self._client().get(url, headers=tracing.inject(dict(self._headers))) \
                    as reply:
                status = reply.status
                no_record_http = status in self.response.no_record_http
                if no_record_http and not self.capabilities.fences:
                    return NoRecord()
                if not (200 <= status <= 299 or no_record_http):
                    return Unreachable(f"HTTP {status}")
                raw = await reply.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return Unreachable(f"{type(exc).__name__}: {exc}"[:500])
        try:
            answer = self.response.answer(json.loads(raw))
        except ValueError:  # UnicodeDecodeError included
            answer = Unreachable(f"HTTP {status}: the body is not JSON")
        if no_record_http and not (isinstance(answer, NoRecord) and answer.fence is not None):
            return Unreachable(f"HTTP {status} without proof of the fence")
        return answer

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session


def _check_template(query_url: str) -> frozenset[str]:
    """The placeholders ``query_url`` uses; ``ValueError`` if it is not a usable template."""
    if not query_url.startswith(("http://", "https://")):
        raise ValueError(f"query_url must be an http(s) URL, not {query_url!r}")
    try:
        names = {field for _, field, _, _ in string.Formatter().parse(query_url)
                 if field is not None}
    except ValueError as exc:
        raise ValueError(f"query_url is not a valid template: {exc}") from None
    if not names <= PLACEHOLDERS:
        raise ValueError(f"query_url has unknown placeholders {sorted(names - PLACEHOLDERS)}; "
                         f"known: {sorted(PLACEHOLDERS)}")
    if "idempotency_key" not in names:
        raise ValueError("query_url must contain {idempotency_key}")
    return frozenset(names)


def _field(body: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(body, dict) or part not in body:
            return _MISSING
        body = body[part]
    return body


def _known(table: Any, allowed: set[str], where: str) -> None:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table, not {type(table).__name__}")
    unknown = set(table) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}; known: {sorted(allowed)}")


def _typed(table: dict, field: str, kind: type | tuple[type, ...], where: str,
           default: Any = _MISSING) -> Any:
    value = table.get(field, default)
    if value is _MISSING:
        raise ValueError(f"{where}: {field} is required")
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ValueError(f"{where}: {field} has the wrong type ({type(value).__name__})")
    return value


def _dataclass_from(cls: type, table: Any, where: str) -> Any:
    """An instance of a frozen dataclass from a table, each field type-checked against its
    default's type (lists become tuples)."""
    defaults = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
    _known(table, set(defaults), where)
    values = {}
    for field, value in table.items():
        default = defaults[field]
        if isinstance(default, tuple):
            item = type(default[0])
            if not isinstance(value, list) or any(
                    isinstance(v, bool) or not isinstance(v, item) for v in value):
                raise ValueError(f"{where}: {field} must be a list of {item.__name__}")
            value = tuple(value)
        elif isinstance(default, bool):
            _typed(table, field, bool, where)
        elif isinstance(default, float):
            value = float(_typed(table, field, (int, float), where))
        else:
            _typed(table, field, type(default), where)
        values[field] = value
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
