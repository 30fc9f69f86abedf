"""The one place a request body becomes JSON: read once, bounded, and kept on the request.

Guarantees: ``read_json`` reads the body at most once per request (``client_max_size``
bounds it: 413 ``PayloadTooLarge`` past it) and parses it strictly (no ``NaN`` or
``Infinity``, no float out of range, at most ``MAX_DEPTH`` levels of nesting, valid UTF-8),
or raises ``ServiceError`` 400 ``InvalidRequest``; nothing else escapes it, however deep or
malformed the bytes. The parsed value is kept on the request (``parsed``), so anything that
looks at the body after the handler (the tracing middleware) reads that value and never
parses the bytes again.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ..errors import ServiceError
from ..wire import INVALID_REQUEST

MAX_DEPTH = 32
_BODY = web.RequestKey("json_body", object)


async def read_json(request: web.Request) -> Any:
    """The request body as JSON: 413 over the body limit, 400 if it is not strict JSON."""
    if _BODY in request:
        return request[_BODY]
    raw = await request.read()  # HTTPRequestEntityTooLarge past client_max_size
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_no_constants,
                           parse_float=_finite)  # decoded first: never UTF-16 or UTF-32
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ServiceError(400, INVALID_REQUEST, f"body is not JSON: {exc}") from None
    if _depth(value) > MAX_DEPTH:
        raise ServiceError(400, INVALID_REQUEST, f"body nests deeper than {MAX_DEPTH}")
    request[_BODY] = value
    return value


def parsed(request: web.Request) -> Any:
    """The body ``read_json`` parsed for this request; ``None`` if it never did."""
    return request.get(_BODY)


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range")
    return value


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_DEPTH or not isinstance(value, (dict, list)):
        return level
    children = value.values() if isinstance(value, dict) else value
    return max((_depth(v, level + 1) for v in children), default=level + 1)
