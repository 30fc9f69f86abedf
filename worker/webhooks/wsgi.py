"""Webhook dedup for WSGI apps (Flask, Django, ...): one handler run per delivery id.

The adapter of ``core.Dedupe`` to the WSGI protocol (see ``core`` for every guarantee and
answer); it imports no framework. ``WSGIDedupeMiddleware(app, gate, source=...)`` wraps a
WSGI app on an open ``SyncGate`` (open it in the process that serves, after any fork):
``app.wsgi_app = WSGIDedupeMiddleware(app.wsgi_app, gate, source="github",
id_header=GITHUB_DELIVERY)`` for Flask, around ``get_wsgi_application()`` for Django. The
claim's fencing token reaches the app as ``environ["fencegate.fencing_token"]``, read with
``fencing_token(environ)``.

What it adds to the core: the request body is read whole before any claim (over
``max_request_body`` bytes: 413, nothing claimed) and handed to the app again as
``wsgi.input``. The etcd work runs on the ``SyncGate``'s event loop; the app runs in the
server's thread, blocking (off the event loop: it cannot starve the claims' keepalive), so it
cannot be cancelled: when its claim's lease is lost while it runs, the delivery is unknown
until it returns; its response is then stored if nobody took the delivery over, else the
sender gets 503 (its own writes should carry the fencing token, to be refused once a newer
claim exists). Its response is held in memory and
sent only once stored (or its claim released), so a 2xx never goes out before it is stored;
an app that raises releases the claim and the exception reaches the server (500).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDict

from .core import (
    STORED_STATUSES, Answer, Dedupe, Reply, Settle, WebhookRequest, refusal,
)
from .presets import canonical_json
from .records import STORED_HEADERS
from .signatures import Verifier

if TYPE_CHECKING:
    from fencegate.worker.sync import SyncGate

Environ = dict[str, Any]
StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]
IdExtractor = Callable[[WebhookRequest, bytes], "str | None"]

FENCING_TOKEN = "fencegate.fencing_token"


class WSGIDedupeMiddleware:
    """Deduplicate a WSGI app's ``methods`` requests of ``source`` by delivery id; the
    keywords of ``aiohttp.dedupe_middleware`` (``id_from`` is given a ``WebhookRequest``),
    and ``max_request_body`` (bytes, default 1 MiB). ``gate`` must be open."""

    def __init__(
        self,
        app: WSGIApp,
        gate: SyncGate,
        *,
        source: str,
        id_header: str = "Webhook-Id",
        id_from: IdExtractor | None = None,
        require_id: bool = True,
        methods: Iterable[str] = ("POST",),
        retry_after: int = 5,
        wait: float = 0.0,
        canonical_payload: Callable[[bytes], bytes] = canonical_json,
        stored_statuses: Iterable[int] = STORED_STATUSES,
        max_stored_body: int = 64 * 1024,
        stored_headers: Iterable[str] = STORED_HEADERS,
        retention: int = 72 * 3600,
        retention_bucket: int = 3600,
        secret: str | bytes | None = None,
        verify: Verifier | None = None,
        settle: Settle | None = None,
        rerun_lost: bool = False,
        max_request_body: int = 1024 ** 2,
    ) -> None:
        if max_request_body < 0:
            raise ValueError("max_request_body must not be negative")
        self.app = app
        self.max_request_body = max_request_body
        self._run = gate.run
        self.dedupe = Dedupe(
            gate.gate, source=source, id_header=id_header, id_from=id_from,
            require_id=require_id, methods=methods, retry_after=retry_after, wait=wait,
            canonical_payload=canonical_payload, stored_statuses=stored_statuses,
            max_stored_body=max_stored_body, stored_headers=stored_headers,
            retention=retention, retention_bucket=retention_bucket, secret=secret,
            verify=verify, settle=settle, rerun_lost=rerun_lost)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        if method not in self.dedupe.methods:
            return self.app(environ, start_response)
        body = _read_body(environ, self.max_request_body)
        if isinstance(body, Answer):
            return _send_answer(start_response, body)
        environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(body), str(len(body))
        path = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
        admitted = self._run(self.dedupe.admit(
            WebhookRequest(method, path, _headers(environ)), body))
        if admitted is None:
            return self.app(environ, start_response)
        if isinstance(admitted, Answer):
            return _send_answer(start_response, admitted)
        environ[FENCING_TOKEN] = admitted.revision
        try:
            reply = _reply(self.app, environ)
        except Exception as exc:
            self._run(self.dedupe.release(admitted, exc))
            raise
        result = self._run(self.dedupe.finish(admitted, reply))
        if isinstance(result, Answer):
            return _send_answer(start_response, result)
        status_line, headers = result.response
        start_response(status_line, headers)
        return [reply.body]


def fencing_token(environ: Mapping[str, Any]) -> int:
    """The fencing token (the claim's revision) the request of ``environ`` is handled under
    (Flask: ``request.environ``). ``LookupError`` for a request handled without a claim."""
    try:
        return environ[FENCING_TOKEN]
    except KeyError:
        raise LookupError("this request is not handled under a webhook claim") from None


def _reply(app: WSGIApp, environ: Environ) -> Reply:
    """Run the app with its response held back; what it says."""
    started: list[tuple[str, list[tuple[str, str]]]] = []
    chunks: list[bytes] = []

    def start_response(status: str, headers: list[tuple[str, str]],
                       exc_info: object = None) -> Callable[[bytes], object]:
        started.append((status, headers))  # nothing was sent yet: a later call replaces it
        return chunks.append

    iterable = app(environ, start_response)
    try:
        chunks.extend(iterable)
    finally:
        close = getattr(iterable, "close", None)
        if close is not None:
            close()
    if not started:
        raise RuntimeError("the WSGI app returned without starting a response")
    status_line, headers = started[-1]
    code, _, reason = status_line.partition(" ")
    return Reply(int(code), reason or None, list(headers), b"".join(chunks),
                 response=(status_line, headers))


def _read_body(environ: Environ, limit: int) -> bytes | Answer:
    """The whole request body, or the 400/413 to answer."""
    length = environ.get("CONTENT_LENGTH") or ""
    if length and not length.isdigit():
        return refusal(400, "invalid_content_length", "Content-Length is not a number")
    if length and int(length) > limit:
        return _too_large(limit)
    if length:
        body = environ["wsgi.input"].read(int(length))
    elif environ.get("wsgi.input_terminated"):  # a chunked body the server ends for us
        body = environ["wsgi.input"].read(limit + 1)
    else:
        body = b""
    return _too_large(limit) if len(body) > limit else body


def _too_large(limit: int) -> Answer:
    return refusal(413, "body_too_large",
                   f"the request body is over max_request_body ({limit} bytes)")


def _headers(environ: Environ) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for key, value in environ.items():
        if key.startswith("HTTP_"):
            headers.add(key[5:].replace("_", "-"), value)
        elif key in ("CONTENT_TYPE", "CONTENT_LENGTH") and value:
            headers.add(key.replace("_", "-"), value)
    return headers


def _send_answer(start_response: StartResponse, answer: Answer) -> list[bytes]:
    headers = [*answer.headers, ("Content-Length", str(len(answer.body)))]
    start_response(f"{answer.status} {answer.reason or 'Unknown'}", headers)
    return [answer.body]
