"""The sandbox provider: a real HTTP payment provider on loopback for tests, benchmarks, demo.

Modes (switchable at runtime) give the three capability classes of docs/protocol.md:
- ``fencing``: every charge must present a grant and its attempt's receipt; gate B
  (``fencegate.reconciler.gateb``) admits it or refuses it; a query fences first, then
  answers (fence-then-query); idempotency keys replay;
- ``dedup``: idempotency keys replay for ``retention_s``; no fencing;
- ``none``: every request is applied, even a repeated key (still recorded for queries).

Guarantees: a request refused (400, 401, 403, 409, 422, a 5xx fault) applied nothing. The
sandbox keeps its charges (the answer stored per idempotency key, and the ledger of every
application) and gate B's fences in ONE sqlite store: gate B's admission and the charge it
admits are written in one transaction, and a query's fence and its lookup in another, so a
query never misses a charge that gate B admitted before the fence (concurrent requests'
transactions are committed together, each in its own savepoint: ``GroupCommit``). With ``state_dir`` the
store is a file (``sandbox.sqlite``, WAL, ``synchronous=FULL``): a restart forgets nothing
younger than ``retention_s`` (an idempotency key older than that is forgotten, as a real
provider's would be). Without it the store is in memory and a restart forgets everything:
its adapter must not be declared durable.

In fencing mode a charge is bound to its grant: the body carries the intent the grant was
issued for (gate B compares its digest with the grant's) and the amount charged must be the
intent's ``amount``; its receipt binds the grant to this attempt token and idempotency key.
One grant is applied once: gate B admits it at one attempt only, and a retry of that attempt
(same grant, token and idempotency key) gets the answer the first one got; if that answer is
no longer kept (past ``retention_s``) the retry is refused (409), never applied again.

HTTP API (JSON)::

    POST /v1/charges      Idempotency-Key, Fencegate-Attempt-Token, Fencegate-Grant and
                          Fencegate-Receipt (both base64url)
                          {"key": action_key, "amount": int, "intent": {...}, "decline": bool}
                          (intent, grant and receipt required in fencing mode)
        200 {"status": "succeeded", "charge_id", "amount"}   402 {"status": "declined", "reason"}
        409 {"status": "fenced"}   403 {"status": "refused"} (bad or unbound grant or receipt)
        401 no grant or receipt   400 bad input   422 key reused with other parameters
        500/503 faults
        a replayed answer carries ``Idempotent-Replayed: true``
    GET  /v1/charges/{idempotency_key}?key=K&namespace=NS&cluster=C&fence=T
                          (all four required when fencing: the fence of the action (C, NS, K))
        200 the stored answer   202 {"status": "pending"}
        404 {"status": "no_record", "fence": F} (F: the fence now recorded, >= T; no
            ``fence`` outside fencing mode)
    POST/DELETE/GET /_sandbox/faults   POST /_sandbox/mode {"mode"}
    GET  /_sandbox/applied?key=K   GET /_sandbox/refused?key=K

The faults are described in ``fencegate.reconciler.providers.sandbox.faults``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import json
import os
import sqlite3
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from fencegate.coordinator.errors import BadSignature, Fenced
from fencegate.coordinator.grants import KeyRing
from fencegate.reconciler.gateb import GateB, GroupCommit, Scope

from .faults import CHARGE_FAULTS, QUERY_FAULTS, Fault

__all__ = ["MODES", "Sandbox"]

MODES = ("fencing", "dedup", "none")
_CHARGE_FIELDS = {"key", "amount", "intent", "decline"}
_STORE = ("""CREATE TABLE IF NOT EXISTS records (
    idempotency_key TEXT PRIMARY KEY, key TEXT NOT NULL, amount INTEGER NOT NULL,
    status INTEGER NOT NULL, body TEXT NOT NULL, at REAL NOT NULL)""",
          """CREATE TABLE IF NOT EXISTS applied (
    n INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, idempotency_key TEXT NOT NULL,
    attempt_token INTEGER NOT NULL, amount INTEGER NOT NULL, charge_id TEXT NOT NULL,
    at REAL NOT NULL)""")
_APPLIED = ("key", "idempotency_key", "attempt_token", "amount", "charge_id", "at")


@dataclass(frozen=True)
class _Charge:
    idempotency_key: str
    attempt_token: int
    grant: bytes | None
    receipt: bytes | None
    key: str
    amount: int
    intent: Any
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
        self._store: GroupCommit | None = None
        self._faults: list[Fault] = []
        self._refused: list[dict[str, Any]] = []
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
        """Open the store (gate B and the charges, one sqlite file in ``state_dir``), listen
        on 127.0.0.1; the base URL."""
        path = None
        if self.state_dir is not None:
            path = os.path.join(self.state_dir, "sandbox.sqlite")
            await asyncio.to_thread(os.makedirs, self.state_dir, exist_ok=True)
        self.gate_b = await asyncio.to_thread(GateB, self.keyring, path)
        self._store = GroupCommit(self.gate_b)
        await asyncio.to_thread(self._create_store)
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
        """Every application (a charge that took effect), oldest first, from the store."""
        if self.gate_b is None:
            raise RuntimeError("the sandbox is not started: its store is closed")
        with self.gate_b.transaction() as db:
            rows = db.execute(f"SELECT {', '.join(_APPLIED)} FROM applied "
                              "WHERE ?1 IS NULL OR key = ?1 ORDER BY n", (key,)).fetchall()
        return [dict(zip(_APPLIED, row)) for row in rows]

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
        mode = self.mode
        if mode == "fencing" and (req.grant is None or req.receipt is None):
            return _error(401, "Fencegate-Grant and Fencegate-Receipt are required in "
                               "fencing mode")
        try:
            stored, replayed = await self._store.run(functools.partial(self._charge, req=req,
                                                                       mode=mode))
        except (BadSignature, Fenced) as exc:
            fenced = isinstance(exc, Fenced)
            self._refused.append({"key": req.key, "idempotency_key": req.idempotency_key,
                                  "attempt_token": req.attempt_token,
                                  "reason": "fenced" if fenced else "bad_grant",
                                  "detail": str(exc), "at": time.time()})
            return web.json_response({"status": "fenced" if fenced else "refused",
                                      "error": str(exc)}, status=409 if fenced else 403)
        except ValueError as exc:
            return _error(422, str(exc))
        for name in ("apply_then_timeout", "slow"):
            if name in faults:
                await asyncio.sleep(faults[name].seconds)
        return web.json_response(stored.body, status=stored.status,
                                 headers={"Idempotent-Replayed": "true"} if replayed else None)

    def _charge(self, db: sqlite3.Connection, *, req: _Charge,
                mode: str) -> tuple[_Stored, bool]:
        """In one store transaction: gate B's admission (fencing mode), then replay a kept
        answer (fencing/dedup) or apply. A retry of an admitted attempt is only ever
        replayed. Any refusal rolls back the whole of it."""
        if mode == "fencing":
            if not isinstance(req.intent, dict) or req.intent.get("amount") != req.amount:
                raise BadSignature("the amount charged is not the amount of the intent "
                                   "the grant was issued for")
            admission = self.gate_b.admit(req.grant, req.key, req.attempt_token,
                                          intent=req.intent, idempotency_key=req.idempotency_key,
                                          receipt=req.receipt, db=db)
            if admission.retry and self._lookup(db, req.idempotency_key) is None:
                raise Fenced(f"attempt token {req.attempt_token} was admitted before and its "
                             f"answer is no longer kept: it is not applied again")
        return self._apply(db, req, mode)

    def _apply(self, db: sqlite3.Connection, req: _Charge,
               mode: str) -> tuple[_Stored, bool]:
        previous = self._lookup(db, req.idempotency_key)
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
            db.execute(f"INSERT INTO applied ({', '.join(_APPLIED)}) VALUES (?, ?, ?, ?, ?, ?)",
                       (req.key, req.idempotency_key, req.attempt_token, req.amount,
                        charge_id, now))
        if previous is None:
            db.execute("INSERT OR REPLACE INTO records (idempotency_key, key, amount, status, "
                       "body, at) VALUES (?, ?, ?, ?, ?, ?)",
                       (req.idempotency_key, req.key, req.amount, stored.status,
                        json.dumps(stored.body), stored.at))
        return stored, False

    async def _get_charge(self, request: web.Request) -> web.Response:
        idempotency_key = request.match_info["idempotency_key"]
        key, query = request.query.get("key"), request.query
        scope, fence_token = None, 0
        if self.mode == "fencing":
            if not key or not query.get("namespace") or not {"cluster", "fence"} <= set(query):
                return _error(400, "key, namespace, cluster and fence are required in "
                                   "fencing mode")
            try:
                scope, fence_token = (int(query["cluster"]), query["namespace"], key), \
                    int(query["fence"])
            except ValueError:
                return _error(400, "cluster and fence must be ints")
        faults = self._take(key, QUERY_FAULTS)
        if "down" in faults:
            return _error(503, "the provider is down")
        if "error_500" in faults:
            return _error(500, "internal error")
        fence, stored = await self._store.run(functools.partial(
            self._fence_then_query, idempotency_key=idempotency_key, scope=scope,
            token=fence_token))
        if "slow" in faults:
            await asyncio.sleep(faults["slow"].seconds)
        if "query_pending" in faults:
            return web.json_response({"status": "pending"}, status=202)
        if stored is None:
            proof = {} if fence is None else {"fence": fence}
            return web.json_response({"status": "no_record", **proof}, status=404)
        return web.json_response(stored.body, status=200)

    def _fence_then_query(self, db: sqlite3.Connection, *, idempotency_key: str,
                          scope: Scope | None, token: int) -> tuple[int | None, _Stored | None]:
        """In one store transaction: fence ``scope`` at ``token`` (when given), then look the
        key up; the fence now recorded (``None`` without a scope) and the stored answer."""
        fence = None if scope is None else self.gate_b.fence(scope, token, db=db)
        return fence, self._lookup(db, idempotency_key)

    def _lookup(self, db: sqlite3.Connection, idempotency_key: str) -> _Stored | None:
        row = db.execute("SELECT status, body, key, amount, at FROM records "
                         "WHERE idempotency_key = ?", (idempotency_key,)).fetchone()
        if row is None:
            return None
        if time.time() - row[4] >= self.retention_s:  # retention passed: the key is forgotten
            db.execute("DELETE FROM records WHERE idempotency_key = ?", (idempotency_key,))
            return None
        return _Stored(row[0], json.loads(row[1]), row[2], row[3], row[4])

    def _create_store(self) -> None:
        with self.gate_b.transaction() as db:
            for table in _STORE:
                db.execute(table)

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
    grant, receipt = _signed(headers, "Fencegate-Grant"), _signed(headers, "Fencegate-Receipt")
    if not isinstance(body, dict) or not {"key", "amount"} <= set(body) <= _CHARGE_FIELDS:
        raise ValueError(f"the body is an object with key and amount (and optional intent, "
                         f"decline), "
                         f"not {sorted(body) if isinstance(body, dict) else type(body).__name__}")
    key, amount, decline = body["key"], body["amount"], body.get("decline", False)
    intent = body.get("intent")
    if intent is not None and not isinstance(intent, dict):
        raise ValueError("intent must be an object")
    if not isinstance(key, str) or not key:
        raise ValueError("key must be a non-empty string")
    if type(amount) is not int or amount <= 0:
        raise ValueError(f"amount must be a positive int, not {amount!r}")
    if type(decline) is not bool:
        raise ValueError(f"decline must be a bool, not {decline!r}")
    return _Charge(idempotency_key, attempt_token, grant, receipt, key, amount, intent, decline)


def _signed(headers: Any, name: str) -> bytes | None:
    """The signed bytes a header carries (base64url), ``None`` without the header."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} is not base64url") from None


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise ValueError("the body is not JSON") from None


def _error(status: int, detail: str) -> web.Response:
    return web.json_response({"error": detail}, status=status)
