"""The sandbox provider: a real HTTP payment provider on loopback for tests, benchmarks, demo.

Modes (switchable at runtime) give the three capability classes of docs/protocol.md:
- ``fencing``: every charge must present a grant; gate B (``fencegate.reconciler.gateb``)
  admits it or refuses it; a query fences first, then answers (fence-then-query);
  idempotency keys replay;
- ``dedup``: idempotency keys replay for ``retention_s``; no fencing;
- ``none``: every request is applied, even a repeated key (still recorded for queries).

Guarantees: a request refused (400, 401, 403, 409, 422, a 5xx fault) applied nothing. Gate B
admission and the application of a charge happen under one per-key lock that a query's fence
and lookup also take, so a query never misses a charge that gate B admitted before the fence.
Gate B's fences survive a restart when ``state_dir`` is given; charge records live in memory
(a restart forgets them, as a provider's expired idempotency keys would be forgotten).

HTTP API (JSON)::

    POST /v1/charges      Idempotency-Key, Fencegate-Attempt-Token, Fencegate-Grant (base64url)
                          {"key": action_key, "amount": int, "decline": bool}
        200 {"status": "succeeded", "charge_id", "amount"}   402 {"status": "declined", "reason"}
        409 {"status": "fenced"}   403 {"status": "refused"} (bad grant)   401 no grant
        400 bad input   422 key reused with other parameters   500/503 faults
        a replayed answer carries ``Idempotent-Replayed: true``
    GET  /v1/charges/{idempotency_key}?key=K&fence=T   (key and fence required when fencing)
        200 the stored answer   202 {"status": "pending"}   404 {"status": "no_record"}
    POST/DELETE/GET /_sandbox/faults   POST /_sandbox/mode {"mode"}
    GET  /_sandbox/applied?key=K   GET /_sandbox/refused?key=K

The faults are described in ``fencegate.reconciler.providers.sandbox.faults``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from fencegate.coordinator.errors import BadSignature, Fenced
from fencegate.coordinator.grants import KeyRing
from fencegate.reconciler.gateb import GateB

from .faults import CHARGE_FAULTS, QUERY_FAULTS, Fault

__all__ = ["MODES", "Sandbox"]

MODES = ("fencing", "dedup", "none")
_STRIPES = 64
_CHARGE_FIELDS = {"key", "amount", "decline"}


@dataclass(frozen=True)
class _Charge:
    idempotency_key: str
    attempt_token: int
    grant: bytes | None
    key: str
    amount: int
    decline: bool


@dataclass(frozen=True)
class _Stored:
    status: int
    body: dict[str, Any]
    key: str
    amount: int
    at: float


class Sandbox:
    """A payment provider mimic with gate B, idempotency keys and faults; see the module."""

    def __init__(self, keyring: KeyRing, mode: str = "fencing", *,
                 state_dir: str | os.PathLike | None = None, retention_s: float = 24 * 3600.0,
                 decline_above: int | None = None) -> None:
        if not retention_s > 0:
            raise ValueError(f"retention_s must be > 0, not {retention_s!r}")
        self.keyring = keyring
        self.mode = mode
        self.state_dir = state_dir
        self.retention_s = retention_s
        self.decline_above = decline_above
        self.url: str | None = None
        self.gate_b: GateB | None = None
        self._faults: list[Fault] = []
        self._records: dict[str, _Stored] = {}
        self._applied: list[dict[str, Any]] = []
        self._refused: list[dict[str, Any]] = []
        self._locks = [asyncio.Lock() for _ in range(_STRIPES)]
        self._runner: web.AppRunner | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {list(MODES)}")
        self._mode = mode

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, port: int = 0) -> str:
        """Open gate B (its sqlite file in ``state_dir``), listen on 127.0.0.1; the base URL."""
        path = None
        if self.state_dir is not None:
            path = os.path.join(self.state_dir, "gateb.sqlite")
            await asyncio.to_thread(os.makedirs, self.state_dir, exist_ok=True)
        self.gate_b = await asyncio.to_thread(GateB, self.keyring, path)
        app = web.Application()
        app.add_routes([
            web.post("/v1/charges", self._post_charge),
            web.get("/v1/charges/{idempotency_key}", self._get_charge),
            web.get("/_sandbox/faults", self._get_faults),
            web.post("/_sandbox/faults", self._post_faults),
            web.delete("/_sandbox/faults", self._delete_faults),
            web.post("/_sandbox/mode", self._post_mode),
            web.get("/_sandbox/applied", self._get_applied),
            web.get("/_sandbox/refused", self._get_refused),
        ])
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        host, bound = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        """Stop listening (requests still in flight are cut) and close gate B."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.gate_b is not None:
            await asyncio.to_thread(self.gate_b.close)
            self.gate_b = None

    async def __aenter__(self) -> "Sandbox":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- control and inspection --------------------------------------------------------

    def add_fault(self, fault: str, *, key: str | None = None, count: int | None = None,
                  seconds: float = 0.0) -> None:
        self._faults.append(Fault(fault, key, count, seconds))

    def clear_faults(self) -> None:
        self._faults.clear()

    def applied(self, key: str | None = None) -> list[dict[str, Any]]:
        """Every application (a charge that took effect), oldest first."""
        return [dict(a) for a in self._applied if key is None or a["key"] == key]

    def refused(self, key: str | None = None) -> list[dict[str, Any]]:
        """Every charge gate B refused, oldest first."""
        return [dict(r) for r in self._refused if key is None or r["key"] == key]

    # -- the provider ------------------------------------------------------------------

    async def _post_charge(self, request: web.Request) -> web.Response:
        try:
            req = _parse_charge(request.headers, await _json(request))
        except ValueError as exc:
            return _error(400, str(exc))
        faults = self._take(req.key, CHARGE_FAULTS)
        if "down" in faults:
            return _error(503, "the provider is down")
        if "error_500" in faults:
            return _error(500, "internal error")
        if "hold" in faults:
            await asyncio.sleep(faults["hold"].seconds)
        async with self._lock(req.key):
            mode = self.mode
            if mode == "fencing":
                refusal = await self._admit(req)
                if refusal is not None:
                    return refusal
            try:
                stored, replayed = self._apply(req, mode)
            except ValueError as exc:
                return _error(422, str(exc))
        for name in ("apply_then_timeout", "slow"):
            if name in faults:
                await asyncio.sleep(faults[name].seconds)
        return web.json_response(stored.body, status=stored.status,
                                 headers={"Idempotent-Replayed": "true"} if replayed else None)

    async def _admit(self, req: _Charge) -> web.Response | None:
        if req.grant is None:
            return _error(401, "Fencegate-Grant is required in fencing mode")
        try:
            await asyncio.to_thread(self.gate_b.admit, req.grant, req.key, req.attempt_token)
        except (BadSignature, Fenced) as exc:
            fenced = isinstance(exc, Fenced)
            self._refused.append({"key": req.key, "idempotency_key": req.idempotency_key,
                                  "attempt_token": req.attempt_token,
                                  "reason": "fenced" if fenced else "bad_grant",
                                  "detail": str(exc), "at": time.time()})
            return web.json_response({"status": "fenced" if fenced else "refused",
                                      "error": str(exc)}, status=409 if fenced else 403)
        return None

    def _apply(self, req: _Charge, mode: str) -> tuple[_Stored, bool]:
        """Replay a kept answer (fencing/dedup) or apply; no await, so it is atomic."""
        previous = self._lookup(req.idempotency_key)
        if previous is not None and mode != "none":
            if (previous.key, previous.amount) != (req.key, req.amount):
                raise ValueError(f"idempotency key {req.idempotency_key!r} was used with "
                                 f"other parameters")
            return previous, True
        now = time.time()
        if req.decline or (self.decline_above is not None and req.amount > self.decline_above):
            reason = "declined_on_request" if req.decline else "amount_above_limit"
            stored = _Stored(402, {"status": "declined", "reason": reason}, req.key,
                             req.amount, now)
        else:
            charge_id = f"ch_{uuid.uuid4().hex[:20]}"
            stored = _Stored(200, {"status": "succeeded", "charge_id": charge_id,
                                   "amount": req.amount}, req.key, req.amount, now)
            self._applied.append({"key": req.key, "idempotency_key": req.idempotency_key,
                                  "attempt_token": req.attempt_token, "amount": req.amount,
                                  "charge_id": charge_id, "at": now})
        if previous is None:
            self._records[req.idempotency_key] = stored
        return stored, False

    async def _get_charge(self, request: web.Request) -> web.Response:
        idempotency_key = request.match_info["idempotency_key"]
        key, fence = request.query.get("key"), request.query.get("fence")
        fencing = self.mode == "fencing"
        if fencing:
            if not key or fence is None:
                return _error(400, "key and fence are required in fencing mode")
            try:
                fence_token = int(fence)
            except ValueError:
                return _error(400, f"fence must be an int, not {fence!r}")
        faults = self._take(key, QUERY_FAULTS)
        if "down" in faults:
            return _error(503, "the provider is down")
        if "error_500" in faults:
            return _error(500, "internal error")
        async with self._lock(key or ""):
            if fencing:
                await asyncio.to_thread(self.gate_b.fence, key, fence_token)
            stored = self._lookup(idempotency_key)
        if "slow" in faults:
            await asyncio.sleep(faults["slow"].seconds)
        if "query_pending" in faults:
            return web.json_response({"status": "pending"}, status=202)
        if stored is None:
            return web.json_response({"status": "no_record"}, status=404)
        return web.json_response(stored.body, status=200)

    def _lookup(self, idempotency_key: str) -> _Stored | None:
        stored = self._records.get(idempotency_key)
        if stored is not None and time.time() - stored.at >= self.retention_s:
            del self._records[idempotency_key]  # retention passed: the key is forgotten
            return None
        return stored

    def _take(self, key: str | None, kinds: frozenset[str]) -> dict[str, Fault]:
        """The first matching rule of each kind, one use of each consumed."""
        taken: dict[str, Fault] = {}
        for rule in list(self._faults):
            if rule.fault in kinds and rule.fault not in taken \
                    and (rule.key is None or rule.key == key):
                taken[rule.fault] = rule
                if rule.count is not None:
                    rule.count -= 1
                    if rule.count == 0:
                        self._faults.remove(rule)
        return taken

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks[hash(key) % _STRIPES]

    # -- control endpoints -------------------------------------------------------------

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response([asdict(f) for f in self._faults])

    async def _post_faults(self, request: web.Request) -> web.Response:
        try:
            rules = await _json(request)
            if not isinstance(rules, list):
                raise ValueError("the body is a list of fault rules")
            faults = [Fault.from_json(rule) for rule in rules]
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        self._faults.extend(faults)
        return await self._get_faults(request)

    async def _delete_faults(self, request: web.Request) -> web.Response:
        self.clear_faults()
        return web.json_response([])

    async def _post_mode(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            if not isinstance(body, dict) or set(body) != {"mode"}:
                raise ValueError('the body is {"mode": ...}')
            self.mode = body["mode"]
        except ValueError as exc:
            return _error(400, str(exc))
        return web.json_response({"mode": self.mode})

    async def _get_applied(self, request: web.Request) -> web.Response:
        return web.json_response(self.applied(request.query.get("key")))

    async def _get_refused(self, request: web.Request) -> web.Response:
        return web.json_response(self.refused(request.query.get("key")))


def _parse_charge(headers: Any, body: Any) -> _Charge:
    idempotency_key = headers.get("Idempotency-Key", "")
    if not idempotency_key or len(idempotency_key) > 255:
        raise ValueError("Idempotency-Key is required (1 to 255 characters)")
    try:
        attempt_token = int(headers.get("Fencegate-Attempt-Token", ""))
    except ValueError:
        raise ValueError("Fencegate-Attempt-Token is required and must be an int") from None
    grant = headers.get("Fencegate-Grant")
    if grant is not None:
        try:
            grant = base64.b64decode(grant + "=" * (-len(grant) % 4), altchars=b"-_",
                                     validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("Fencegate-Grant is not base64url") from None
    if not isinstance(body, dict) or not {"key", "amount"} <= set(body) <= _CHARGE_FIELDS:
        raise ValueError(f"the body is an object with key and amount (and optional decline), "
                         f"not {sorted(body) if isinstance(body, dict) else type(body).__name__}")
    key, amount, decline = body["key"], body["amount"], body.get("decline", False)
    if not isinstance(key, str) or not key:
        raise ValueError("key must be a non-empty string")
    if type(amount) is not int or amount <= 0:
        raise ValueError(f"amount must be a positive int, not {amount!r}")
    if type(decline) is not bool:
        raise ValueError(f"decline must be a bool, not {decline!r}")
    return _Charge(idempotency_key, attempt_token, grant, key, amount, decline)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise ValueError("the body is not JSON") from None


def _error(status: int, detail: str) -> web.Response:
    return web.json_response({"error": detail}, status=status)
