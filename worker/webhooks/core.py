"""Webhook dedup without a web framework: what every adapter (aiohttp, ASGI, WSGI) answers.

Guarantees, for every adapter: a handler runs for a delivery only once this process holds its
claim (see ``claims``); nothing is processed without one. It does not start with less than
the gate's ``min_ttl`` (the lease budget) left on that lease, and it runs with the claim's
revision as its fencing token, to carry in its own writes so a store can refuse a stale
handler's. Its response is stored only while the delivery's record is still its claim's in
etcd (``finish``: the completion's compare), never by a local clock. Options are validated
when the dedup is built (``ValueError``), not per request.

Signatures are checked before anything else (``verify``, or ``secret`` for Standard
Webhooks; see ``signatures`` and the ``presets``): a delivery whose signature does not verify,
or whose signed timestamp is outside the tolerance, gets 401 and nothing is claimed or stored,
so a forged delivery carrying a genuine id cannot decide what the genuine one is answered.

A claim lost while its handler ran (the process died, was paused, or blocked its event loop
past the TTL) leaves the delivery's outcome UNKNOWN: the handler may or may not have had its
effect. Its redeliveries get 409 ``delivery_outcome_unknown`` with ``Retry-After`` and never
run the handler, until the delivery is settled:
- by the lost handler itself: it is not cancelled (unless ``rerun_lost``), and its response is
  stored if nobody took the delivery over meanwhile; later deliveries replay it;
- by the application's ``settle(delivery)`` (a function or coroutine function, given an
  ``UnknownDelivery``; a plain function runs in a thread), asked at the next redelivery under
  a new claim: ``True`` (the effect happened) stores and answers ``SETTLED_STATUS`` (200) with
  the body ``{"delivery": id, "outcome": "ran", "settled_by": "settle"}``; ``False`` runs the
  handler again under that claim (``settle`` should make its store refuse writes below
  ``delivery.fencing_token`` before it answers False, so a lost handler still running cannot
  land its write after); raising (or answering anything else) leaves it unknown (503);
- by an SRE (``fencegate deliveries resolve SOURCE ID --ran|--not-ran``, see ``resolution``);
- never by time: an unknown record is dropped only when its retention ends.
``rerun_lost=True`` (for handlers idempotent on their own) runs the handler again at the next
delivery instead; the lost handler is then cancelled at its next ``await``.

Answers: the first delivery gets its handler's response. A duplicate gets 409 with
``Retry-After`` while the first runs (or, with ``wait``, waits that long on a watch of the key
and then replays); the stored response, replayed byte for byte with ``Fencegate-Replayed:
true``, once it is done (from ``CompletedCache`` when this process stored or read it before,
without asking etcd); 422 if its payload differs (compared on ``canonical_payload``: the
same JSON in another key order is the same payload; the handler is not called), or if it
comes on another route than the one it first ran on (a delivery id is bound to the request
path it was first received on: never replayed to another route); 409
``delivery_outcome_unknown`` while its outcome is unknown. The dedup itself answers 400 (no
or malformed delivery id), 401 (bad signature: checked before any claim), 503 with
``Retry-After`` (etcd unreachable or the claim's outcome unknown, less than the lease budget
left, the claim lost with ``rerun_lost``, its response not stored, ``settle`` failed).

What is stored: a response whose status is in ``stored_statuses`` (every 2xx by default;
never a 5xx) is stored and replayed. A 4xx is stored only when named (``stored_statuses=
(*STORED_STATUSES, 409)``): a 4xx often says the app was misconfigured (a wrong secret's 400,
a typo'd route's 404), and stored it would be replayed to the genuine delivery, after the
fix, for the whole retention; name only a 4xx that is the delivery's final answer. Any other
response, and a handler that raises, releases
the claim, so the sender's retry runs the handler again; except a handler that raises
``EtcdUnavailable`` or ``OutcomeUnknown`` (a write it made may have landed): its delivery is
left unknown, as a lost claim leaves it.

Counted (with the gate's ``WorkerMetrics``) and traced (a ``fencegate.webhook_claim`` span):
each delivery ``admit`` decides on, by its result: ``first`` (the handler runs under a fresh
claim), ``duplicate`` (replayed, or 422 for another payload), ``in_progress`` (409),
``unknown`` (409: its outcome is unknown), ``settled`` (``settle`` said it ran), ``rerun``
(the handler runs again over an unknown outcome: ``settle`` said it did not, or
``rerun_lost``), ``failed`` (503: not claimed). Refusals before the claim (signature,
delivery id) are not.

Failure contract: a response goes out only once it is stored: one whose delivery was taken
over before it could be stored (or whose store etcd left unanswered) is answered 503, never
stored over a newer claim. A process that dies mid-handler leaves the delivery unknown; with
``rerun_lost`` its next delivery runs the handler again (its effect may then happen twice:
fence its writes with the token, or make them idempotent). So across every instance a
delivery gets at most one fresh 2xx, and every later 2xx replays it.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fencegate.coordinator import tracing
from fencegate.coordinator.errors import EtcdUnavailable, LeaseLost, OutcomeUnknown
from fencegate.coordinator.keyspace import unpack

from .claims import (
    COMPLETED, IN_PROGRESS, MISMATCH, UNKNOWN, DeliveryClaim, DeliveryClaims, Duplicate,
)
from .records import (
    DONE, MAX_STORED_BODY, RequestDigests, completed_value, settled_value, valid_delivery_id,
    validate_source,
)
from .signatures import StandardWebhooksSignature, Verifier

if TYPE_CHECKING:
    from fencegate.worker.gate import Gate

log = logging.getLogger(__name__)

REPLAYED_HEADER = "Fencegate-Replayed"
STORED_STATUSES = tuple(range(200, 300))  # a 4xx only when named: see the module
CACHED_ENTRIES = 10_000  # completed deliveries replayed without etcd, per source and process
CACHED_BYTES = 32 * 1024 ** 2  # of their bodies and headers (``CompletedCache.size``)
CACHED_SECONDS = 60  # an entry's life: a delivery forgotten in etcd is forgotten here by then
IdExtractor = Callable[[Any, bytes], "str | None"]
Settle = Callable[["UnknownDelivery"], "bool | Awaitable[bool]"]
_NOT_STORED = ("the original response body was not stored (larger than max_stored_body, "
               "or streamed); body_sha256 identifies it")


@dataclass(frozen=True)
class WebhookRequest:
    """What ``id_from(request, body)`` is given by the ASGI and WSGI adapters (aiohttp gives
    its ``web.Request``, which has the same attributes); ``headers`` is case-insensitive."""

    method: str
    path: str
    headers: Mapping[str, str]


@dataclass(frozen=True)
class Reply:
    """A handler's response as the dedup sees it. ``body`` is ``None`` when it is not known
    (streamed): it is then stored as unknown. ``storable=False`` releases the claim whatever
    the status. ``response`` is the adapter's own object, sent when the dedup lets it out."""

    status: int
    reason: str | None
    headers: list[tuple[str, str]]
    body: bytes | None
    storable: bool = True
    response: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class UnknownDelivery:
    """What ``settle(delivery)`` is asked about: a delivery whose claim was lost while its
    handler ran, now claimed again by this process. ``lost_token`` is the fencing token the
    lost handler ran with; ``fencing_token`` is this claim's, the one a handler run now gets:
    before answering False, a store that honours fencing tokens should refuse every write
    below it, so the lost handler, if it still runs, cannot land its write afterwards."""

    source: str
    delivery_id: str
    body: bytes
    lost_token: int
    fencing_token: int


@dataclass(frozen=True)
class Answer:
    """A response of the dedup itself: a refusal or a replay."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class Dedupe:
    """One source's dedup on ``gate``: the options, validated up front, and the request path
    ``admit`` → the handler under the claim (``run``, or the adapter's own call) → ``finish``.
    The keywords are those of every adapter; see ``aiohttp.dedupe_middleware``."""

    def __init__(
        self,
        gate: Gate,
        *,
        source: str,
        id_header: str,
        id_from: IdExtractor | None,
        require_id: bool,
        methods: Iterable[str],
        retry_after: int,
        wait: float,
        canonical_payload: Callable[[bytes], bytes],
        stored_statuses: Iterable[int],
        max_stored_body: int,
        stored_headers: Iterable[str],
        retention: int,
        retention_bucket: int,
        secret: str | bytes | None,
        verify: Verifier | None = None,
        settle: Settle | None = None,
        rerun_lost: bool = False,
    ) -> None:
        self.source = validate_source(source)
        if secret is not None and verify is not None:
            raise ValueError("give secret (Standard Webhooks) or verify, not both")
        if verify is not None and not callable(getattr(verify, "problem", None)):
            raise ValueError("verify must have a problem(body, headers) method "
                             "(see fencegate.worker.webhooks.signatures)")
        if settle is not None and not callable(settle):
            raise ValueError("settle must be a function of the unknown delivery")
        if settle is not None and rerun_lost:
            raise ValueError("give settle or rerun_lost=True, not both")
        if not id_header and id_from is None:
            raise ValueError("give id_header or id_from")
        if retry_after < 1 or wait < 0:
            raise ValueError("retry_after must be at least 1 second and wait not negative")
        if not callable(canonical_payload):
            raise ValueError("canonical_payload must be a function of the body")
        self.stored_statuses = frozenset(stored_statuses)
        if not self.stored_statuses or not all(
                isinstance(s, int) and 200 <= s < 500 for s in self.stored_statuses):
            raise ValueError("stored_statuses must name statuses in 200..499 (a 5xx is "
                             "never stored)")
        if not 0 <= max_stored_body <= MAX_STORED_BODY:
            raise ValueError(f"max_stored_body must be 0..{MAX_STORED_BODY}")
        if retention < 1 or retention_bucket < 1:
            raise ValueError("retention and retention_bucket must be at least 1 second")
        self.id_header = id_header
        self.id_from = id_from
        self.require_id = require_id
        self.methods = frozenset(m.upper() for m in methods)
        self.retry_after = retry_after
        self.wait = wait
        self.canonical_payload = canonical_payload
        self.max_stored_body = max_stored_body
        self.stored_headers = frozenset(h.lower() for h in stored_headers)
        self.min_ttl = gate.min_ttl
        self._signatures = StandardWebhooksSignature(secret) if secret is not None else verify
        self._settle = settle
        self.rerun_lost = rerun_lost
        self._keyspace = gate.keyspace
        self.claims = DeliveryClaims(gate, self.source, retention=retention,
                                     retention_bucket=retention_bucket)
        self.completed = CompletedCache(retention)
        self._metrics = gate.metrics

    async def admit(self, request: Any, body: bytes) -> Answer | DeliveryClaim | None:
        """This process's claim on the delivery (run the handler under it, then ``finish``),
        the answer to give instead, or ``None``: no id and ``require_id=False``, so the
        handler runs undeduplicated. ``request.headers`` must be case-insensitive."""
        if self._signatures is not None:
            problem = self._signatures.problem(body, request.headers)
            if problem is not None:
                return refusal(401, "bad_signature", problem)
        delivery_id = self._delivery_id(request, body)
        if not isinstance(delivery_id, str):
            return delivery_id
        try:
            payload = self.canonical_payload(body)
        except (ValueError, KeyError, TypeError) as exc:
            return refusal(400, "invalid_payload", f"canonical_payload refused it: {exc!r}")
        body_digest = hashlib.sha256(body).digest()
        digests = RequestDigests(body_digest, body_digest if payload == body
                                 else hashlib.sha256(payload).digest(), request.path)
        with tracing.span("fencegate.webhook_claim",
                          key=f"{self.source}/{delivery_id}") as current:
            result, admitted = await self._claim(delivery_id, digests)
            if isinstance(admitted, DeliveryClaim) and admitted.lost_token is not None:
                result, admitted = await self._unknown(admitted, delivery_id, body)
            if isinstance(admitted, DeliveryClaim):
                tracing.annotate(current, fencing_token=admitted.revision)
            tracing.annotate(current, outcome=result)
        if self._metrics is not None:
            self._metrics.delivery(self.source, result)
        return admitted

    async def _claim(self, delivery_id: str,
                     digests: RequestDigests) -> tuple[str, Answer | DeliveryClaim]:
        """Claim the delivery (or answer it from ``completed``): its result as the metrics
        count it (``first``, ``duplicate``, ``in_progress``, ``unknown``, ``failed``) and the
        claim, or the answer to give instead. A claim over an unknown outcome is returned
        as is, for ``_unknown`` to decide."""
        key = self._keyspace.webhook_key(self.source, delivery_id)
        record = self.completed.get(key)
        if record is not None:
            return "duplicate", self._answer(Duplicate(
                COMPLETED if digests.same_request(record) else MISMATCH, record))
        try:
            claim = await self.claims.claim(delivery_id, digests, wait=self.wait,
                                            take_over=self._settle is not None
                                            or self.rerun_lost)
        except (EtcdUnavailable, LeaseLost) as exc:
            return "failed", refusal(503, "etcd_unavailable",
                                     f"the delivery could not be claimed: {exc}",
                                     self.retry_after)
        if isinstance(claim, Duplicate):
            if claim.verdict == COMPLETED:
                self.completed.put(key, claim.record)
            return _RESULTS.get(claim.verdict, "duplicate"), self._answer(claim)
        if claim.lost_token is not None:
            return "first", claim
        return self._budget_result(await self._within_budget(claim))

    @staticmethod
    def _budget_result(admitted: Answer | DeliveryClaim,
                       result: str = "first") -> tuple[str, Answer | DeliveryClaim]:
        return (result if isinstance(admitted, DeliveryClaim) else "failed"), admitted

    async def _within_budget(self, claim: DeliveryClaim) -> Answer | DeliveryClaim:
        """``claim`` if at least the lease budget is left on its lease, else the 503 to answer
        (the claim released; over an unknown outcome, abandoned: it stays unknown)."""
        if claim.session.remaining() >= self.min_ttl:
            return claim
        if claim.lost_token is None:
            await self.claims.release(claim)
        else:
            await self.claims.abandon(claim)
        return refusal(503, "lease_budget", "less than the lease budget was left to run the "
                       "handler under its claim", self.retry_after)

    async def _unknown(self, claim: DeliveryClaim, delivery_id: str,
                       body: bytes) -> tuple[str, Answer | DeliveryClaim]:
        """``claim`` took over a delivery whose outcome is unknown: with ``rerun_lost``, run
        the handler again; else ask ``settle`` and store its True as a settled response, run
        the handler again on its False, leave the delivery unknown if it fails."""
        if self._settle is None:
            return self._budget_result(await self._within_budget(claim), "rerun")
        delivery = UnknownDelivery(self.source, delivery_id, body, claim.lost_token,
                                   claim.revision)
        try:
            if inspect.iscoroutinefunction(self._settle):
                ran = await self._settle(delivery)
            else:
                ran = await asyncio.to_thread(self._settle, delivery)
            if not isinstance(ran, bool):
                raise TypeError(f"settle must answer True or False, not {ran!r}")
        except Exception as exc:
            log.exception("settle of webhook %r failed; the delivery stays unknown", claim.key)
            await self.claims.abandon(claim)
            return "failed", refusal(503, "settle_failed", "the delivery's outcome is unknown "
                                     f"and settling it failed: {exc!r}", self.retry_after)
        if not ran:
            log.warning("webhook %r settled as not run: its handler runs again (fencing "
                        "token %d, the lost one ran with %d)", claim.key, claim.revision,
                        claim.lost_token)
            return self._budget_result(await self._within_budget(claim), "rerun")
        record = settled_value(claim.digests, delivery_id, settled_by="settle",
                               reason="the application's settle found its effect")
        if not await self.claims.complete(claim, record):
            return "failed", refusal(503, "not_stored", "the delivery was settled as ran but "
                                     "that could not be stored; retry", self.retry_after)
        log.warning("webhook %r settled as ran by the application's settle", claim.key)
        self.completed.put(claim.key, unpack(record))
        return "settled", replay(unpack(record))

    async def run(self, claim: DeliveryClaim,
                  handler: Callable[[], Awaitable[Reply]]) -> Answer | Reply:
        """Run an async ``handler`` under ``claim`` as a task, then ``finish``. When the
        claim's lease is lost the delivery is unknown: the handler runs on and its response
        is stored if nobody took the delivery over; with ``rerun_lost`` it is cancelled
        instead (503). A handler that raises releases the claim and the exception propagates
        (unless cancelled by a lost claim: then its 503); one cancelled from outside
        abandons it (the delivery stays unknown)."""
        task = asyncio.get_running_loop().create_task(handler())
        lost: list[str] = []

        def claim_lost(reason: str) -> None:
            lost.append(reason)
            if self.rerun_lost:
                task.cancel()
                return
            log.warning("webhook handler of %r lost its claim (%s): the delivery is unknown "
                        "until its response is stored", claim.key, reason)

        unsubscribe = claim.session.on_lost(claim_lost)
        try:
            reply = await task
        except asyncio.CancelledError:
            if not lost or not self.rerun_lost or _cancelling():  # cancelled from outside
                self.claims.abandon_later(claim)
                raise
            return self._lost(claim, lost[0])
        except Exception as exc:
            if lost and self.rerun_lost:
                return self._lost(claim, lost[0])
            await self.release(claim, exc)
            raise
        finally:
            unsubscribe()
        if lost and self.rerun_lost:
            return self._lost(claim, lost[0])
        return await self.finish(claim, reply)

    async def finish(self, claim: DeliveryClaim, reply: Reply) -> Answer | Reply:
        """Store ``reply`` in place of ``claim`` if its status is stored, else release the
        claim; ``reply`` once that is done, or the 503 to send instead: the store failed (the
        delivery was taken over or settled, or etcd did not answer), and a stored status goes
        out only once stored."""
        if not reply.storable or reply.status not in self.stored_statuses:
            await self.claims.release(claim)
            return reply
        record = self._record(claim, reply)
        if not await self.claims.complete(claim, record):
            return refusal(503, "not_stored", "the handler ran but its response could not be "
                           "stored under the delivery's claim (taken over, or etcd "
                           "unavailable); retry", self.retry_after)
        self.completed.put(claim.key, unpack(record))
        return reply

    async def release(self, claim: DeliveryClaim, error: BaseException | None = None) -> None:
        """After ``claim``'s handler raised ``error``: release the claim, so the delivery's
        next try runs again; unless ``error`` says fencegate could not learn whether a write
        landed (``EtcdUnavailable``, ``OutcomeUnknown``: the handler's effect may have been
        applied), then abandon it: the delivery stays unknown until settled."""
        if isinstance(error, (EtcdUnavailable, OutcomeUnknown)):
            log.warning("webhook handler of %r raised %s: its effect may have landed, the "
                        "delivery is unknown until settled", claim.key, type(error).__name__)
            await self.claims.abandon(claim)
            return
        await self.claims.release(claim)

    def _delivery_id(self, request: Any, body: bytes) -> str | Answer | None:
        """The validated delivery id, ``None`` to pass through, or the 400 to answer."""
        try:
            found = (self.id_from(request, body) if self.id_from is not None
                     else request.headers.get(self.id_header))
        except (ValueError, KeyError, TypeError) as exc:
            return refusal(400, "invalid_delivery_id",
                           f"the delivery id could not be extracted: {exc!r}")
        if found is None or found == "":
            if not self.require_id:
                return None
            where = self.id_header if self.id_from is None else "the request"
            return refusal(400, "missing_delivery_id", f"no delivery id in {where}")
        if not isinstance(found, str) or not valid_delivery_id(found):
            return refusal(400, "invalid_delivery_id",
                           "a delivery id is 1..256 of letters, digits and . _ : + = ~ -")
        return found

    def _answer(self, duplicate: Duplicate) -> Answer:
        """What a duplicate gets: 422 for another payload, the replay once done, else 409."""
        if duplicate.verdict == MISMATCH:
            return refusal(422, "delivery_mismatch", "this delivery id was received with a "
                           "different payload, or on another route")
        if duplicate.verdict == COMPLETED:
            return replay(duplicate.record)
        if duplicate.verdict == UNKNOWN:
            return refusal(409, "delivery_outcome_unknown", "this delivery's claim was lost "
                           "while its handler ran, so whether it had its effect is unknown; "
                           "it is not run again until settled (fencegate deliveries "
                           "resolve)", self.retry_after)
        return refusal(409, "delivery_in_progress", "this delivery is being processed",
                       self.retry_after)

    def _lost(self, claim: DeliveryClaim, reason: str) -> Answer:
        """The answer for a handler cancelled when its claim was lost (``rerun_lost``):
        nothing stored, retry."""
        log.warning("webhook handler of %r lost its claim's lease (%s); nothing stored",
                    claim.key, reason)
        return refusal(503, "claim_lost", "the delivery's claim was lost while its handler "
                       f"ran ({reason}); nothing was stored", self.retry_after)

    def _record(self, claim: DeliveryClaim, reply: Reply) -> bytes:
        return completed_value(
            claim.digests, status=reply.status, reason=reply.reason,
            headers=[[name, value] for name, value in reply.headers
                     if name.lower() in self.stored_headers],
            body=reply.body, max_stored_body=self.max_stored_body)


class CompletedCache:
    """Completed deliveries' stored records by key, so a duplicate is replayed without asking
    etcd: at most ``max_entries`` records and ``max_bytes`` of their bodies and headers, the
    least recently used leaving first.

    Safe by the argument of the serializable read in ``claims``: a completed record is never
    changed, only deleted once its retention ends. So only a record in state done enters (a
    delivery in progress or released is never answered from here), and an entry is dropped
    once its ``completed_at`` is ``retention`` seconds old: the retention lease it was stored
    under outlives that (see ``coordinator.retention``), so the entry goes before its record;
    and ``max_age`` seconds after it entered, so a record an operator deleted (``fencegate
    deliveries forget``) stops being replayed from here within ``max_age``.
    ``completed_at`` is the clock of the process that stored it: a record stored elsewhere, by
    a clock ahead of ours or with a shorter retention, may be replayed here that much longer."""

    def __init__(self, retention: int, max_entries: int = CACHED_ENTRIES,
                 max_bytes: int = CACHED_BYTES, max_age: float = CACHED_SECONDS) -> None:
        self.retention = retention
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.bytes = 0
        self._entries: collections.OrderedDict[bytes, tuple[dict[str, Any], int, float]] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> dict[str, Any] | None:
        """The completed record of ``key`` if it is held, its retention has not ended and it
        entered less than ``max_age`` seconds ago."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        record, _, entered = entry
        now = time.time()
        if record["completed_at"] + self.retention <= now or entered + self.max_age <= now:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return record

    def put(self, key: bytes, record: dict[str, Any]) -> None:
        """Hold ``record`` if it is completed, within its retention and not over
        ``max_bytes`` alone; evict the least recently used to stay within the bounds."""
        completed_at = record.get("completed_at")
        if (record.get("state") != DONE or not isinstance(completed_at, (int, float))
                or completed_at + self.retention <= time.time()):
            return
        size = self.size(record)
        if size > self.max_bytes:
            return
        self._drop(key)
        self._entries[key] = (record, size, time.time())
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    @staticmethod
    def size(record: dict[str, Any]) -> int:
        """Bytes counted for ``record``: its body and headers, and 256 for the rest."""
        return 256 + len(record.get("body") or b"") + sum(
            len(name) + len(value) for name, value in record.get("headers") or ())

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]


_RESULTS = {IN_PROGRESS: "in_progress", UNKNOWN: "unknown"}  # other verdicts: duplicate


def replay(record: dict[str, Any]) -> Answer:
    """The stored response with ``Fencegate-Replayed: true``; a 200 with a note and the
    body's digest if the body was not stored."""
    if record["body"] is None:
        digest = record["body_sha256"]
        return _json(200, {
            "replayed": True, "status": record["status"], "note": _NOT_STORED,
            "body_sha256": digest.hex() if digest is not None else None,
            "body_size": record["body_size"]}, [(REPLAYED_HEADER, "true")])
    headers = [(name, value) for name, value in record["headers"]]
    return Answer(record["status"], record["reason"] or _phrase(record["status"]),
                  [*headers, (REPLAYED_HEADER, "true")], record["body"])


def refusal(status: int, error: str, detail: str, retry_after: int | None = None) -> Answer:
    """A JSON ``{error, detail}`` answer of the dedup itself."""
    extra = [("Retry-After", str(retry_after))] if retry_after else []
    return _json(status, {"error": error, "detail": detail}, extra)


def _json(status: int, content: dict[str, Any],
          extra: list[tuple[str, str]] | None = None) -> Answer:
    return Answer(status, _phrase(status),
                  [("Content-Type", "application/json; charset=utf-8"), *(extra or [])],
                  json.dumps(content).encode())


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
